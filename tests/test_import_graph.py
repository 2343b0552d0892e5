"""ember's modules import each other one way: no circle, counting every import (at the top, in a
function, or under TYPE_CHECKING). attention/backend.py and attention/metadata.py were the last
circle (ForwardContext now lives in attention/context.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import ember

ROOT = Path(ember.__file__).parent


def module_graph() -> dict[str, set[str]]:
    """Each ember module -> the ember modules it imports."""
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                graph[m].add(node.module)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                graph[m] |= {f"{node.module}.{a.name}" for a in node.names} & files.keys()
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names} & files.keys()
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m] - {m}):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_circle_finder_finds_a_circle() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_ember_has_no_import_circle() -> None:
    graph = module_graph()
    assert "ember.attention.context" in graph["ember.models.llama"]
    assert "ember.attention.backend" not in graph["ember.attention.metadata"]
    assert find_circle(graph) is None
