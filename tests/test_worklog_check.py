"""scripts/check_worklog.py on small git repositories: a clean one passes, a work-log phrase in a
tracked file or a session number in a file name fails, naming the file (and the line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_worklog.py"

CLEAN = {
    "README.md": "# demo\n\nRun `bench --sessions 8 --turns 3` against the server.\n",
    "src/app.py": '"""An HTTP session per client; session affinity keeps a session on one engine."""\n'
    "SESSIONS = 4  # sessions: 4, tissue 3, session_id 7 in a struct field\n",
    "data/trace.jsonl": '{"session_id": 3, "turn": 1}\n',
}


def N(text: str) -> str:
    """A planted phrase: written here with `{n}` so that this file passes the check itself."""
    return text.format(n=3, m=12)


def repo(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    root = tmp_path / "repo"
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)
    return root


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60
    )


def test_a_clean_repository_passes(tmp_path: Path) -> None:
    binary = (
        b"\x89PNG\r\n\x00\x00 " + N("session {n} issue {n}").encode()
    )  # a binary file is not read
    root = repo(tmp_path, {**CLEAN, "logo.png": binary})
    (root / "untracked.md").write_text(N("session {n}\n"))  # only tracked files count
    r = check(root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    "phrase",
    ["as measured in session {n}", "Session {n}'s rule", "see issue #{n}", "issues {n} and {m}",
     "(Sessions {n}-{m})", "issue {n}"],
)  # fmt: skip
def test_a_work_log_phrase_fails_and_is_named(tmp_path: Path, phrase: str) -> None:
    phrase = N(phrase)
    notes = f"# Notes\n\nThe cache was reverted {phrase}.\n"
    root = repo(tmp_path, {**CLEAN, "docs/notes.md": notes})
    r = check(root)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [f"docs/notes.md:3: The cache was reverted {phrase}."]


def test_a_session_number_in_a_file_name_fails(tmp_path: Path) -> None:
    root = repo(tmp_path, {**CLEAN, N("results/x-session{n}.json"): "{}\n"})
    r = check(root)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        N("results/x-session{n}.json: the file name carries a session or issue number")
    ]
