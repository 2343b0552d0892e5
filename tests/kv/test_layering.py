"""`kv/` sits below the engine: nothing in it imports from the packages above it (engine, models,
server, router, entrypoints, cli), so the KV cache and its tiers take plain values only."""

from __future__ import annotations

import ast
from pathlib import Path

import ember

KV = Path(ember.__file__).parent / "kv"
ABOVE = ("engine", "models", "server", "router", "entrypoints", "cli", "cluster", "bench")


def imported_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_kv_imports_nothing_from_above() -> None:
    files = sorted(KV.rglob("*.py"))
    assert len(files) > 5
    bad = [
        f"{f.relative_to(KV.parent)}: {m}"
        for f in files
        for m in imported_modules(f)
        if m.split(".")[:2] in (["ember", pkg] for pkg in ABOVE)
    ]
    assert not bad, "kv/ reaches up into the engine's floors:\n" + "\n".join(bad)
