"""The map's dependency rules, held by a test (ARCHITECTURE.md, "Dependency rules")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ("engine.telemetry", "engine.switches", "engine.config", "engine.option_checks", "engine.errors",
            "engine.api", "engine.snapshot", "engine.prefill_cost", "engine.step")
LOADGEN = ("engine.loadgen.scenarios", "engine.loadgen.scenario_types", "engine.loadgen.load_client")
TORCH_FREE_ENGINE = CONTRACT + LOADGEN + tuple(
    f"engine.core.{p.stem}" for p in sorted((ROOT / "engine" / "core").glob("*.py")) if p.stem != "__init__")
# Layers, top to bottom (docs/ARCHITECTURE.md): a module may import its own layer and the layers below it.
LAYERS = {
    "engine.cli": 6, "engine.bench": 6, "engine.train": 6,
    "engine.server": 5,
    "engine.orchestration": 4,
    "engine.exec": 3, "engine.core": 3, "engine.loadgen": 3,
    "engine.model": 2,
    **{m: 1 for m in CONTRACT},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module in ("engine", "engine.loadgen", "engine.core", "engine.exec"):  # `from engine import x`
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", TORCH_FREE_ENGINE)
def test_torch_free_engine_modules_import_without_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"{module} pulled torch in"


def test_strata_tui_never_imports_torch_or_engine_internals() -> None:
    allowed_engine = set(CONTRACT) | set(LOADGEN) | {"engine", "engine.loadgen"}
    for path in sorted((ROOT / "strata_tui").rglob("*.py")):
        for name in _imports(path):
            assert name.split(".")[0] != "torch", f"{path} imports torch"
            if name.split(".")[0] == "engine":
                assert name in allowed_engine, f"{path} imports {name}, not a torch-free engine module"


def test_strata_tui_package_imports_without_torch() -> None:
    code = "import sys, importlib, pkgutil, strata_tui\n" \
           "for m in pkgutil.walk_packages(strata_tui.__path__, 'strata_tui.'): importlib.import_module(m.name)\n" \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_engine_never_imports_strata_tui_or_textual() -> None:
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for name in _imports(path):
            assert name.split(".")[0] not in ("strata_tui", "textual"), f"{path} imports {name}"


def test_engine_model_imports_torch_and_itself_only() -> None:
    stdlib = set(sys.stdlib_module_names)
    allowed = {"torch", "safetensors", "tokenizers", "jinja2", "numpy", "triton", "gguf"}
    for path in sorted((ROOT / "engine" / "model").rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in stdlib or top in allowed:
                continue
            assert name.startswith("engine.model") or name == "engine.errors", f"{path} imports {name}"


def test_the_serving_core_is_pure_python() -> None:
    paths = sorted((ROOT / "engine" / "core").glob("*.py"))
    assert {p.stem for p in paths} >= {"scheduler", "request", "prefix_index", "prefill_pacer"}
    for path in paths:
        for name in _imports(path):
            assert name.split(".")[0] not in ("torch", "numpy"), f"{path} imports {name}"
            if name.startswith("engine."):
                assert name.startswith("engine.core") or name in CONTRACT, f"{path} imports {name}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _engine_graph(package: str = "engine") -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (TYPE_CHECKING imports included: a circle there is one too)."""
    modules = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name and d != package}
    return graph


def _layer(module: str) -> int | None:
    best = max((prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len, default=None)
    return None if best is None else LAYERS[best]


@pytest.mark.parametrize("package", ["engine", "strata_tui"])
def test_the_import_graph_has_no_circles(package: str) -> None:
    graph = _engine_graph(package)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_imports_point_down_the_layers() -> None:
    for module, deps in sorted(_engine_graph().items()):
        own = _layer(module)
        assert own is not None or module == "engine", f"{module} is in no layer: add it to LAYERS"
        for dep in deps:
            below = _layer(dep)
            assert own is None or below is None or below <= own, f"{module} (layer {own}) imports {dep} (layer {below})"


def test_the_core_and_exec_layers_do_not_import_each_other_upwards() -> None:
    graph = _engine_graph()
    for module, deps in graph.items():
        if module.startswith("engine.core"):
            assert not any(d.startswith(("engine.exec", "engine.model")) for d in deps), f"{module} imports torch layers"


def _folder(module: str) -> str:
    """The folder a module lives in: `engine.exec.kv.cache` -> `engine.exec`; a root module is `engine`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if (ROOT / Path(*parts[:2])).is_dir() else parts[0]


def test_the_engine_root_is_the_contract() -> None:
    """The root holds the contract only; the orchestration (engine, setup, async engine, state) has its folder."""
    root = {f"engine.{p.stem}" for p in (ROOT / "engine").glob("*.py") if p.stem != "__init__"}
    assert root == set(CONTRACT), f"not contract at the engine root: {sorted(root - set(CONTRACT))}"


# Folders that never import each other, whatever their layers say: the benchmarks are a front end beside the
# CLI, not under it; the pure core and the torch executor are siblings that the orchestration joins.
NEVERS = (("engine.bench", "engine.cli"), ("engine.exec", "engine.core"), ("engine.core", "engine.exec"),
          ("engine.core", "engine.model"), ("engine.exec", "engine.orchestration"),
          ("engine.model", "engine.exec"))


@pytest.mark.parametrize("importer, imported", NEVERS)
def test_the_nevers(importer: str, imported: str) -> None:
    for module, deps in sorted(_engine_graph().items()):
        if module == importer or module.startswith(importer + "."):
            bad = sorted(d for d in deps if d == imported or d.startswith(imported + "."))
            assert not bad, f"{module} imports {bad}: {importer} never imports {imported}"


@pytest.mark.parametrize("package", ["engine", "strata_tui"])
def test_the_folders_have_no_loops(package: str) -> None:
    folders: dict[str, set[str]] = {}
    for module, deps in _engine_graph(package).items():
        folders.setdefault(_folder(module), set()).update(_folder(d) for d in deps if _folder(d) != _folder(module))
    done: set[str] = set()

    def visit(folder: str, path: list[str]) -> None:
        if folder in path:
            raise AssertionError("folder loop: " + " -> ".join(path[path.index(folder):] + [folder]))
        if folder not in done:
            for dep in sorted(folders.get(folder, ())):
                visit(dep, path + [folder])
            done.add(folder)

    for folder in sorted(folders):
        visit(folder, [])


# engine/exec's floors, bottom to top: the base (errors, fault plan, the executor seam, compile, sampling
# kernels), then kv/, graphs/ and experts/ (beside each other, never importing one another), then the runner,
# the drafter and what drives them.
EXEC_SUBPACKAGES = ("engine.exec.kv", "engine.exec.graphs", "engine.exec.experts")
EXEC_TOP = ("engine.exec.runner", "engine.exec.drafter", "engine.exec.decode_ahead", "engine.exec.device_switches",
            "engine.exec.plan_executor", "engine.exec.prefill_window", "engine.exec.chunk_rows")


def test_exec_is_in_floors() -> None:
    assert all((ROOT / Path(*p.split("."))).is_dir() for p in EXEC_SUBPACKAGES)
    flat = sorted(p.stem for p in (ROOT / "engine" / "exec").glob("*.py"))
    clustered = [s for s in flat if s.startswith(("kv_", "graph", "expert_", "vram", "tier_"))]
    assert not clustered, f"modules of a sub-package's cluster left on exec's flat floor: {clustered}"
    for module, deps in sorted(_engine_graph().items()):
        if not module.startswith("engine.exec."):
            continue
        sub = next((p for p in EXEC_SUBPACKAGES if module == p or module.startswith(p + ".")), None)
        for dep in deps:
            if not dep.startswith("engine.exec."):
                continue
            dep_sub = next((p for p in EXEC_SUBPACKAGES if dep == p or dep.startswith(p + ".")), None)
            if sub is not None:
                assert dep_sub in (None, sub), f"{module} imports {dep}: exec's sub-packages never import each other"
                assert not dep.startswith(EXEC_TOP), f"{module} imports {dep}, a floor above it"
            elif dep_sub is not None or dep.startswith(EXEC_TOP):
                assert module.startswith(EXEC_TOP), f"{module} (exec's base floor) imports {dep}, a floor above it"


# strata_tui's folders, top to bottom (docs/ARCHITECTURE.md, "The TUI"): a module imports its own folder and the
# folders below it, never a folder beside it or above. Its root holds the app alone: the entry, the wiring, how it
# ends.
TUI_ROOT = {"strata_tui.__main__", "strata_tui.cli", "strata_tui.app", "strata_tui.foreign_app", "strata_tui.shutdown",
            "strata_tui.terminal"}
TUI_LAYERS = {
    "strata_tui": 6,
    "strata_tui.screens": 5,
    "strata_tui.widgets": 4, "strata_tui.actions": 4,
    "strata_tui.state": 3,
    "strata_tui.engine_io": 2, "strata_tui.profiles": 2,
    "strata_tui.adapters": 1,
}


def test_the_tui_root_is_the_app() -> None:
    root = {f"strata_tui.{p.stem}" for p in (ROOT / "strata_tui").glob("*.py") if p.stem != "__init__"}
    assert root == TUI_ROOT, f"at strata_tui's root but not the app: {sorted(root - TUI_ROOT)} (give each a folder " \
                             f"by its job); gone: {sorted(TUI_ROOT - root)}"


def test_the_tui_imports_point_down_its_folders() -> None:
    for module, deps in sorted(_engine_graph("strata_tui").items()):
        folder = _folder(module)
        assert folder in TUI_LAYERS, f"{module} is in {folder}, no layer of strata_tui: add it to TUI_LAYERS"
        for dep in deps:
            below = _folder(dep)
            assert below == folder or TUI_LAYERS[below] < TUI_LAYERS[folder], \
                f"{module} ({folder}, layer {TUI_LAYERS[folder]}) imports {dep} ({below}, layer {TUI_LAYERS[below]})"


def test_the_tui_state_is_pure_python() -> None:
    """The state the screens draw is folded from messages without a terminal, a socket or a thread: testable in
    milliseconds, as the engine's core is."""
    paths = sorted((ROOT / "strata_tui" / "state").glob("*.py"))
    assert {p.stem for p in paths} >= {"reducer", "view_state", "monitor_state"}
    for path in paths:
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in ("textual", "httpx", "psutil", "pynvml", "asyncio", "subprocess", "socket",
                               "threading"), f"{path} imports {name}"
