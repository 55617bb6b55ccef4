"""How the engine's parts meet, read from the code: the executor runs a typed plan without the scheduler, and the
builder hands every part what it needs in its constructor (docs/ARCHITECTURE.md, "The engine's step")."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def scheduler_uses(path: Path = ROOT / "engine/exec/plan_executor.py") -> list[str]:
    """Every place the module names a scheduler: an import of the core, a parameter, a name or an attribute."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine.core"):
            found.append(f"line {node.lineno}: imports {node.module}")
        elif isinstance(node, ast.arg) and "sched" in node.arg.lower():
            found.append(f"line {node.lineno}: parameter {node.arg}")
        elif isinstance(node, ast.Attribute) and "sched" in node.attr.lower():
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and "sched" in node.id.lower():
            found.append(f"line {node.lineno}: {node.id}")
    return found


def attributes_set_on_parts(path: Path = ROOT / "engine/orchestration/engine_setup.py") -> list[str]:
    """Assignments in the builder to an attribute of anything but the builder itself (`self`), and setattr."""
    found = []
    for node in ast.walk(_tree(path)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"line {node.lineno}: setattr")
        for target in targets:
            if isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name) and target.value.id == "self"):
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
    return found


def test_the_executor_takes_the_plan_and_never_holds_the_scheduler() -> None:
    from engine.exec.plan_executor import PlanExecutor
    from engine.step import StepPlan, StepResult

    assert scheduler_uses() == [], "the PlanExecutor reads the plan, never the scheduler"
    execute = inspect.signature(PlanExecutor.execute, eval_str=True)
    assert execute.parameters["plan"].annotation is StepPlan and execute.return_annotation is StepResult
    assert not [p for p in inspect.signature(PlanExecutor.__init__).parameters if "sched" in p]


def test_the_step_data_is_the_contract_and_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, engine.step; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_the_builder_sets_no_attribute_on_a_part_after_building_it() -> None:
    for path in (ROOT / "engine/orchestration/engine_setup.py", ROOT / "engine/orchestration/part_makers.py"):
        assert attributes_set_on_parts(path) == [], f"{path.name}: hand it to the part's constructor instead"


def test_the_counters_see_what_they_count(tmp_path: Path) -> None:
    """The two readers above find what they look for (so an empty answer means there is none)."""
    probe = tmp_path / "probe.py"
    probe.write_text("class B:\n    def build(self, sched):\n        runner = R()\n        runner.owner = 1\n"
                     "        self.stage = 'x'\n        setattr(runner, 'a', 2)\n        sched.num_decoding\n")
    assert attributes_set_on_parts(probe) == ["line 4: runner.owner = ...", "line 6: setattr"]
    assert scheduler_uses(probe) == ["line 2: parameter sched", "line 7: sched"]
