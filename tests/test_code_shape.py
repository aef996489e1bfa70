"""Functions short enough to read in one sitting (issue 53): none in ``src/`` over
`MAX_FUNCTION_LINES` lines, nested functions counted within their outer one."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_FUNCTION_LINES = 150


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(f"{path.relative_to(SRC)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_in_src_is_over_150_lines():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    lengths = [entry for path in files for entry in _function_lengths(path)]
    too_long = [f"{name}: {n} lines" for name, n in lengths if n > MAX_FUNCTION_LINES]
    assert not too_long, f"split these into named pieces (at most {MAX_FUNCTION_LINES} lines each): {too_long}"
