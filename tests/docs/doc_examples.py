"""The copyable blocks of the README and the guides, and how each is meant to run.

Every ```sh / ```bash / ```python block in a page is an example a reader may paste, so each must
carry a marker on the line above its fence (docs/contributing.md explains them):

    <!-- example: run -->                 run it; it must exit 0
    <!-- example: run, expect "Paris" --> ... and print that text
    <!-- example: server -->              start it in the background; the page's next blocks run
                                          against it once http://127.0.0.1:8000/health answers
    <!-- example: skip: needs a GPU -->   not run here; the reason is required

Output listings and config files (```text, ```json, ```yaml, a bare ```) are not examples.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUNNABLE_LANGS = {"sh": "bash", "bash": "bash", "shell": "bash", "python": "python", "py": "python"}
"""Fence languages that are examples, and the interpreter each runs with."""

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<body>.*?)\s*-->\s*$")
_EXPECT = re.compile(r'^run\s*,\s*expect\s+"(?P<text>[^"]+)"$')


class MarkerError(ValueError):
    """A block without a marker, or a marker that says nothing runnable."""


@dataclass(frozen=True)
class Example:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str  # the interpreter: bash or python
    kind: str  # run | server | skip
    code: str
    expect: str | None = None
    reason: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_marker(body: str, where: str) -> tuple[str, str | None, str | None]:
    """(kind, expect, reason) of a marker's body; MarkerError for anything else."""
    if body == "run":
        return "run", None, None
    if body == "server":
        return "server", None, None
    if m := _EXPECT.match(body):
        return "run", m["text"], None
    if body.startswith("skip"):
        reason = body[len("skip") :].lstrip(":").strip()
        if not reason:
            raise MarkerError(f"{where}: a skipped example must say why (`skip: needs a GPU`)")
        return "skip", None, reason
    raise MarkerError(f"{where}: unknown example marker {body!r}")


def examples(text: str, page: str) -> list[Example]:
    """The page's examples in order; MarkerError names the first block without a valid marker."""
    lines = text.splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m["fence"], m["lang"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = "\n".join(line[len(m["indent"]) :] for line in lines[i + 1 : end])
        if lang in RUNNABLE_LANGS:
            where = f"{page}:{i + 1}"
            above = lines[i - 1] if i > 0 else ""
            marker = _MARKER.match(above)
            if not marker:
                raise MarkerError(
                    f"{where}: a ```{lang} block with no `<!-- example: ... -->` marker above it"
                )
            kind, expect, reason = parse_marker(marker["body"], where)
            found.append(
                Example(page, i + 1, RUNNABLE_LANGS[lang], kind, body + "\n", expect, reason)
            )
        i = end + 1
    return found


def pages(root: Path) -> list[Path]:
    """The README and every guide."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
