"""ember's modules import each other one way: no circle, and no import up the floors (LAYERS),
counting every import (at the top, in a function, or under TYPE_CHECKING). ForwardContext lives
in attention/context.py so that attention/backend.py and attention/metadata.py need not import
each other."""

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


LEAVES = 0
LAYERS: dict[str, int] = {
    # leaves: the public request/response types and small helpers; they import only each other
    "home": LEAVES,
    "trust": LEAVES,
    "edge_limits": LEAVES,
    "openai_errors": LEAVES,
    "parent_death": LEAVES,
    "sampling_params": LEAVES,
    "kv_transfer_params": LEAVES,
    "outputs": LEAVES,
    # the process group and its collectives (torch alone), under models and engine
    "distributed": 1,
    "host_pages": 1,  # madvise on host buffers (torch alone), under kv and models
    # the model floor and the KV packages
    "kernels": 1,
    "tokenizer": 1,
    "attention": 2,
    "kv": 2,
    "models": 3,
    "spec_decode": 4,
    "engine": 5,
    # the faces
    "entrypoints": 6,
    "server": 6,
    "router": 6,
    "ember": 7,  # ember/__init__.py: `from ember import LLM`
    "bench": 7,
    # the front
    "cluster": 8,
    "cli": 9,
    "up_process": 9,
}
"""Each top-level package or module of ember -> its floor: a module imports only from floors
below its own (leaves also from each other)."""


def floor_of(module: str) -> str:
    """ember.engine.core -> "engine", ember.outputs -> "outputs", ember -> "ember"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that does not run down the floors, as "importer -> imported"."""
    bad = []
    for m, imported in sorted(graph.items()):
        a = LAYERS[floor_of(m)]
        for n in sorted(imported):
            b = LAYERS[floor_of(n)]
            if floor_of(m) != floor_of(n) and not (a > b or a == b == LEAVES):
                bad.append(f"{m} -> {n}")
    return bad


def test_the_circle_finder_finds_a_circle() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_ember_has_no_import_circle() -> None:
    graph = module_graph()
    assert "ember.attention.context" in graph["ember.models.llama"]
    assert "ember.attention.backend" not in graph["ember.attention.metadata"]
    assert find_circle(graph) is None


def test_every_package_has_a_floor() -> None:
    assert {floor_of(m) for m in module_graph()} <= LAYERS.keys()


def test_no_import_runs_up_the_floors() -> None:
    assert upward_imports(module_graph()) == []


def test_an_upward_import_is_refused() -> None:
    graph = module_graph()
    graph["ember.outputs"] = graph["ember.outputs"] | {"ember.engine.messages"}
    graph["ember.kv.block_pool"] = graph["ember.kv.block_pool"] | {"ember.models.config"}
    assert upward_imports(graph) == [
        "ember.kv.block_pool -> ember.models.config",
        "ember.outputs -> ember.engine.messages",
    ]
