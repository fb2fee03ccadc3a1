"""No function in the planner's driver or the parallelizers is over 80 lines: a long function over positional
tuples is where the planner's driver became hard to change. Read with ``ast`` (a function's lines run from its
``def`` to its last statement, decorators and docstring included)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tangram_launch

MAX_LINES = 80
PACKAGES = ("planner", "parallelizers")
ROOT = Path(tangram_launch.__file__).parent
FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
# and the one planning request both command lines build, with the registry and the worker side it reads
ALSO = tuple(ROOT / name for name in ("launch/planning.py", "commands/plan.py", "capabilities.py", "worker.py"))


def long_functions(path: Path, max_lines: int = MAX_LINES) -> list[str]:
    """'name (first line, lines)' of each function or method in ``path`` over ``max_lines`` lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = node.end_lineno - first + 1
            if lines > max_lines:
                out.append(f"{node.name} (line {first}, {lines} lines)")
    return out


def test_the_files_checked_are_the_packages_python_files():
    assert {p.parent.name for p in FILES} == set(PACKAGES)
    assert any(p.name == "compose.py" for p in FILES) and any(p.name == "megatron.py" for p in FILES)


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    src = tmp_path / "long.py"
    src.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(src) == [f"long (line 5, {MAX_LINES + 1} lines)"]


@pytest.mark.parametrize("path", FILES + list(ALSO), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_function_is_over_80_lines(path):
    assert long_functions(path) == [], f"{path}: split these into named steps"
