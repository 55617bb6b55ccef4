"""Product code is there for the product: every top-level function and class, and every method, under engine/ and
strata_tui/ is used by the product (engine/, strata_tui/, benchmarks/, scripts/ or an entry point), not only by its
own tests. A use is code that names it (an attribute, a name, a getattr string), never a word in a docstring."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "strata_tui")
# Methods a framework calls by their name: Textual's handlers, actions, watchers and validators.
BY_NAME = ("on_", "_on_", "action_", "watch_", "_watch_", "compute_", "validate_", "key_")
# Called by a library through a protocol that no base class declares, or kept by a file another change owns.
KEPT = {
    "strata_tui/terminal.py: _DroppingFile.isatty": "Textual's driver asks its output file whether it is a terminal",
    "engine/server/serving.py: Serving.inflight_count": "read by the server's tests only; the server's own pass "
                                                        "removes it or uses it",
}


def _product_files() -> list[Path]:
    return (sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "strata_tui").rglob("*.py"))
            + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py")))


def _uses() -> dict[str, set[Path]]:
    """Every name the product's code refers to, and the files that do."""
    uses: dict[str, set[Path]] = {}
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.alias):
                name = node.name.split(".")[-1]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
            if isinstance(name, str):
                uses.setdefault(name, set()).add(path)
    return uses


def _exported(tree: ast.Module) -> set[str]:
    """The names a module lists in `__all__`."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__" for target in node.targets):
            names.update(item.value for item in ast.walk(node.value)
                         if isinstance(item, ast.Constant) and isinstance(item.value, str))
    return names


def _registered(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated by a framework (a pydantic serializer, a validator): the framework calls it."""
    plain = {"property", "staticmethod", "classmethod", "cached_property", "abstractmethod", "setter"}
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name not in plain:
            return True
    return False


def unused_definitions() -> list[str]:
    """`path: name` (top level) and `path: Class.method` defined in engine/ or strata_tui/ that no product code uses."""
    uses = _uses()
    entry_points = (ROOT / "pyproject.toml").read_text()
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "strata_tui").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=str(path))
        module = None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("__"):
                # a top-level name counts as used when another file uses it, or this one does beyond its definition
                here = sum(1 for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == node.name)
                exported = node.name in _exported(tree)  # the module's public API
                if not (uses.get(node.name, set()) - {path}) and not here and not exported \
                        and node.name not in entry_points:
                    found.append(f"{rel}: {node.name}")
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                name = item.name
                if name.startswith("__") or name.startswith(BY_NAME) or name in uses or _registered(item):
                    continue
                if module is None:
                    module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
                cls = getattr(module, node.name, None)
                if cls is not None and any(name in vars(base) for base in inspect.getmro(cls)[1:]):
                    continue  # an override: whoever calls the base's calls it
                found.append(f"{rel}: {node.name}.{name}")
    return found


def test_every_definition_and_method_has_a_product_caller() -> None:
    unused = [item for item in unused_definitions() if item not in KEPT]
    assert not unused, "defined but never used by the product (dead, or test-only: move it to tests/ or remove " \
                       "it): " + ", ".join(unused)


def test_what_is_kept_is_still_there_and_still_unused() -> None:
    """The list of exceptions only shrinks: an entry whose method is gone or now used goes too."""
    unused = set(unused_definitions())
    assert not [item for item in KEPT if item not in unused], "remove these from KEPT"
