"""The map's dependency rules, held by a test (ARCHITECTURE.md, "Dependency rules")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_FREE_ENGINE = ("engine.telemetry", "engine.switches", "engine.config", "engine.errors", "engine.api")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", TORCH_FREE_ENGINE)
def test_torch_free_engine_modules_import_without_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"{module} pulled torch in"


def test_strata_tui_never_imports_torch_or_engine_internals() -> None:
    allowed_engine = set(TORCH_FREE_ENGINE) | {"engine", "engine.scenarios"}
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
    allowed = {"torch", "safetensors", "tokenizers", "jinja2", "numpy"}
    for path in sorted((ROOT / "engine" / "model").rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in stdlib or top in allowed:
                continue
            assert name.startswith("engine.model") or name == "engine.errors", f"{path} imports {name}"


def test_scheduler_and_request_are_pure_python() -> None:
    for mod in ("scheduler", "request", "prefix_index", "prefill_pacer", "step_plan"):
        path = ROOT / "engine" / f"{mod}.py"
        if not path.exists():
            pytest.skip(f"engine/{mod}.py not written yet")
        assert all(n.split(".")[0] != "torch" for n in _imports(path)), f"{path} imports torch"
