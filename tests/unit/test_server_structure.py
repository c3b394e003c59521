"""The server stays in small parts. The engine's step loop is under 150 lines that import at
most 8 of the project's modules (nano-vllm's engine imports 5): platform set-up, adapters,
admission and building the parts live beside it. And no two modules import each other, not
even through an import inside a function, which is how the structure pass found two cycles
hiding (api/cli <-> api/app, attention/paged <-> attention/cpu_decode)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
ENGINE = SERVER / "engine" / "llm_engine.py"


def project_imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level or node.module.startswith("batchpilot"):
                found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("batchpilot")}
    return found


def test_the_engine_module_is_small():
    text = ENGINE.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) < 150, f"{ENGINE.name}: {len(lines)} non-blank lines"


def test_the_engine_imports_at_most_eight_project_modules():
    modules = {name.rsplit(".", 1)[0] for name in project_imports(ast.parse(ENGINE.read_text()))}
    assert len(modules) <= 8, sorted(modules)


def test_project_imports_are_counted():
    tree = ast.parse("from batchpilot.a import x, y\nimport batchpilot.b\nimport os\n")
    assert project_imports(tree) == {"batchpilot.a.x", "batchpilot.a.y", "batchpilot.b"}


def module_name(path: Path) -> str:
    parts = [p for p in path.relative_to(SERVER).with_suffix("").parts if p != "__init__"]
    return ".".join(["batchpilot.server", *parts])


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the server modules it imports anywhere in its body. ``from pkg import
    name`` points at the submodule when ``name`` is one, else at ``pkg``."""

    def resolve(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in files.items():
        names = project_imports(ast.parse(path.read_text()))
        graph[module] = {resolve(n) for n in names if n.startswith("batchpilot.server")} - {
            module,
            "",
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles_in_the_server():
    files = {module_name(p): p for p in SERVER.rglob("*.py")}
    assert len(files) > 50, "the walk found too few modules"
    assert not cycles(import_graph(files))


def test_a_cycle_through_a_function_level_import_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert not cycles({"a": {"b"}, "b": set()})
