"""The operator stays made of small parts: no function in operator/ over ~60 lines and no
module over 500 (the structure pass split crd.py, resources.py and handlers.py for it)."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
MAX_LINES = 60
MAX_MODULE_LINES = 500


def _modules() -> list[Path]:
    return sorted(OPERATOR.rglob("*.py"))


def test_the_walk_reaches_the_subpackages():
    names = {p.relative_to(OPERATOR).as_posix() for p in _modules()}
    assert {"crd/spec.py", "loop/turn.py", "activator/proxy.py"} <= names


def test_no_function_in_the_operator_is_long():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(
                        f"{path.relative_to(OPERATOR)}:{node.lineno} {node.name} ({lines} lines)"
                    )
    assert not long, long


def test_no_operator_module_is_long():
    sizes = {path.relative_to(OPERATOR): len(path.read_text().splitlines()) for path in _modules()}
    long = [f"{path} ({n} lines)" for path, n in sizes.items() if n > MAX_MODULE_LINES]
    assert not long, long
