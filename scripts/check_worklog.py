"""Fails on work-log phrases in the repository's tracked files: a session or an issue with its
number ("session <n>", "Sessions <n>-<m>", "issue #<n>", "issues <n> and <m>", any case). The code, tests and docs state facts and reasons; which work
session or issue a change came from belongs in git's history, not in the files. File names that
carry a session or issue number (`x-session<n>.json`) fail too. (This file and its test write
the number as `<n>` so that the check passes on itself.)

    python scripts/check_worklog.py [ROOT]   # ROOT: a git work tree (default: this repository)

Prints `path:line: text` for each phrase and `path: ...` for each file name, and exits 1 if there
is any, else 0. Binary files are skipped. A command-line flag (`--sessions 8`) is not a phrase.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PHRASE = re.compile(r"(?<![\w-])(?:session|issue)s?\s?#?\d+", re.IGNORECASE)
"""A session or issue numbered: "session <n>", "Sessions <n>-<m>", "issue #<n>", "issues <n> and
<m>". Not a flag (`--sessions 8`) nor part of a longer word (`tissue <n>`)."""

FILE_NAME = re.compile(r"(?:session|issue)s?[-_]?\d+", re.IGNORECASE)
"""In a path's last part: "x-session<n>.json", "run-issue_<n>.log"."""

BINARY_PROBE = 8192
"""Bytes read to tell a binary file (one holding a NUL byte) from a text file."""


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    return [p for p in out.decode().split("\0") if p]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary, unreadable or missing file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:BINARY_PROBE]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def findings(root: Path) -> list[str]:
    """Every work-log phrase and file name under `root`, as the lines to print."""
    found = []
    for rel in tracked_files(root):
        if FILE_NAME.search(Path(rel).name):
            found.append(f"{rel}: the file name carries a session or issue number")
        text = text_of(root / rel)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if PHRASE.search(line):
                found.append(f"{rel}:{number}: {line.strip()[:200]}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: check_worklog.py [ROOT]", file=sys.stderr)
        return 2
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    found = findings(root)
    for line in found:
        print(line)
    if found:
        print(
            f"check_worklog: {len(found)} work-log phrase(s) or file name(s): state the fact or the "
            "reason instead of the session or issue it came from",
            file=sys.stderr,
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
