"""Write benchmarks/data/stdlib_docstrings.txt, the fixed text benchmarks/quality.py scores: the
docstrings of Python 3.11's standard library (each top-level module's, then its public classes',
methods' and functions', in source order), modules in sorted order, until `--lines` lines.

The sources are parsed with `ast`, never imported (some modules act on import). Run once and commit
the text: another Python's docstrings differ, and every benchmark run must score the same bytes.

    .venv/bin/python scripts/make_quality_text.py [--lines 3000]
"""

from __future__ import annotations

import argparse
import ast
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "stdlib_docstrings.txt"

Documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def docstrings(tree: ast.Module) -> Iterator[str]:
    """The module's docstring, then each public class's, method's and function's, in source order."""
    stack: list[Documented] = [tree]
    while stack:
        node = stack.pop()
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
        children = [
            c
            for c in node.body
            if isinstance(c, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and not c.name.startswith("_")
        ]
        stack.extend(reversed(children))


def stdlib_modules(stdlib: Path) -> list[Path]:
    """Top-level modules of the standard library, private ones left out, by name."""
    return sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))


def collect(stdlib: Path, max_lines: int) -> list[str]:
    lines: list[str] = []
    for path in stdlib_modules(stdlib):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for doc in docstrings(tree):
            lines += [line.rstrip() for line in doc.splitlines()] + [""]
            if len(lines) >= max_lines:
                return lines[:max_lines]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lines", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if sys.version_info[:2] != (3, 11):
        raise SystemExit(f"run this with Python 3.11 (the committed text's), not {sys.version}")
    lines = collect(Path(sysconfig.get_paths()["stdlib"]), args.lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(lines)} lines, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
