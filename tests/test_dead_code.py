"""Product code is there for the product: every top-level function and class under engine/ is used by the
product (engine/, strata_tui/, benchmarks/, scripts/ or an entry point), not only by its own tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_top_level_definition_has_a_product_caller() -> None:
    product = sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "strata_tui").rglob("*.py")) \
        + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    texts = {path: path.read_text() for path in product}
    entry_points = (ROOT / "pyproject.toml").read_text()
    users: dict[str, set[Path]] = {}
    for path, text in texts.items():
        for word in set(re.findall(r"\w+", text)):
            users.setdefault(word, set()).add(path)
    unused = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.parse(texts[path]).body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("__"):
                continue
            elsewhere = users.get(node.name, set()) - {path}
            here = len(re.findall(rf"\b{re.escape(node.name)}\b", texts[path]))
            if not elsewhere and here <= 1 and node.name not in entry_points:
                unused.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not unused, "defined but never used by the product (dead, or test-only: move it to tests/): " \
        + ", ".join(unused)
