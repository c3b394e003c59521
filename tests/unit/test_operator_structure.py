"""The operator stays made of small parts: no function in operator/ over ~60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
MAX_LINES = 60


def test_no_function_in_the_operator_is_long():
    long = []
    for path in sorted(OPERATOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
