"""No function of the planning driver is over 80 lines: a reader new to the code reads each step on one screen, and a
long function is split into named steps with named types rather than grown."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 80
# the planner's driver, the hand-written plans, and the request they are planned from
MODULES = ("tangram_launch/planner/api.py", "tangram_launch/planner/build.py", "tangram_launch/planner/manual.py",
           "tangram_launch/planner/slices.py", "tangram_launch/planner/orders.py",
           "tangram_launch/planner/baselines.py", "tangram_launch/launch/planning.py",
           "tangram_launch/commands/plan.py", "tangram_launch/capabilities.py", "tangram_launch/worker.py")


def long_functions(path: Path, limit: int = MAX_LINES) -> list[str]:
    """``name (lines)`` of every function or method in the file longer than ``limit`` lines, decorators included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - first + 1 > limit:
                out.append(f"{node.name} ({node.end_lineno - first + 1} lines)")
    return out


@pytest.mark.parametrize("module", MODULES)
def test_no_function_is_over_80_lines(module):
    assert long_functions(REPO / module) == [], module


def test_the_measure_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "m.py") == [f"long ({MAX_LINES + 1} lines)"]
