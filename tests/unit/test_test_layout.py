"""The test tree's own layout: test modules share helpers through tests/support/ and
fixtures through conftest.py, never by importing one another, and nothing but
tests/support/wait.py writes a polling loop called wait_for, wait_until or eventually."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("tests", "kind-tests")
SKIP = ("tests/k8s/tools",)  # Go wrapper modules, no Python of ours
WAIT_NAMES = {"wait_for", "wait_until", "eventually"}
WAIT_HOME = "tests/support/wait.py"


def python_files(repo: Path) -> Iterator[Path]:
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            if not rel.startswith(SKIP):
                yield path


def is_test_module(name: str) -> bool:
    """A dotted module name that ends in a test module or a conftest."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imported_test_modules(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if is_test_module(a.name))
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if is_test_module(module):
                yield module
            else:  # from tests.unit import test_x
                yield from (f"{module}.{a.name}" for a in node.names if is_test_module(a.name))


def wait_definitions(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in WAIT_NAMES:
            yield f"{node.name} (line {node.lineno})"


def violations(repo: Path) -> list[str]:
    found = []
    for path in python_files(repo):
        rel = path.relative_to(repo).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        found += [f"{rel} imports {m}" for m in imported_test_modules(tree)]
        if rel != WAIT_HOME:
            found += [f"{rel} defines {d}" for d in wait_definitions(tree)]
    return found


def test_no_test_module_imports_another_or_writes_its_own_wait():
    found = violations(REPO)
    assert not found, (
        "share helpers through tests/support/ (waiting: tests/support/wait.py) and fixtures "
        "through conftest.py:\n" + "\n".join(found)
    )


def test_the_check_catches_each_kind_of_violation(tmp_path):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "kind-tests").mkdir()
    (tmp_path / "tests" / "unit" / "test_a.py").write_text(
        "from tests.unit.test_b import helper\nfrom .conftest import PROMPTS\n"
        "def wait_for(what, predicate):\n    pass\n"
    )
    (tmp_path / "kind-tests" / "test_k.py").write_text(
        "import test_other\nfrom tests.unit import test_b\n"
        "class Load:\n    async def eventually(self):\n        pass\n"
    )
    assert violations(tmp_path) == [
        "tests/unit/test_a.py imports tests.unit.test_b",
        "tests/unit/test_a.py imports .conftest",
        "tests/unit/test_a.py defines wait_for (line 3)",
        "kind-tests/test_k.py imports test_other",
        "kind-tests/test_k.py imports tests.unit.test_b",
        "kind-tests/test_k.py defines eventually (line 4)",
    ]
