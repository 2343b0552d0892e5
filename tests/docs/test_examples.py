"""The README's and the guides' examples, run as a reader would paste them, so the docs cannot drift
from the code. Each page's blocks run in order in a shell with the venv's `ember` first on PATH,
a private EMBER_HOME and the repository as the working directory; a `server` block runs in the
background (its own process group) until the page's next server block or its end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.doc_examples import Example, MarkerError, examples, pages

ROOT = Path(__file__).resolve().parents[2]
PAGES = pages(ROOT)
HEALTH = "http://127.0.0.1:8000/health"
RUN_TIMEOUT_S = 300
SERVER_START_S = 300


@pytest.fixture(scope="module")
def doc_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["EMBER_HOME"] = str(tmp_path_factory.mktemp("ember-home"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _port_8000_busy() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 8000)) == 0


def _healthy() -> bool:
    try:
        with urllib.request.urlopen(HEALTH, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _argv(ex: Example) -> list[str]:
    """The block as a reader would run it: Python blocks in this venv's interpreter, shell blocks
    in bash, stopping at the first failing command."""
    return [sys.executable, "-c", ex.code] if ex.lang == "python" else ["bash", "-e", "-c", ex.code]


class _Background:
    """A server block in its own process group, its output in a file."""

    def __init__(self, ex: Example, env: dict[str, str], log: Path) -> None:
        self.ex, self.log = ex, log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            _argv(ex),
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{self.ex.where}: the server exited ({self.proc.returncode}):\n{self.output()}"
                )
            if _healthy():
                return
            time.sleep(0.5)
        pytest.fail(
            f"{self.ex.where}: {HEALTH} not healthy in {SERVER_START_S} s:\n{self.output()}"
        )

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self._out.close()
        deadline = time.monotonic() + 30
        while _port_8000_busy() and time.monotonic() < deadline:
            time.sleep(0.2)


def _run(ex: Example, env: dict[str, str]) -> None:
    try:
        done = subprocess.run(
            _argv(ex), cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{ex.where}: ran past {RUN_TIMEOUT_S} s:\n{ex.code}")
    out = done.stdout + done.stderr
    assert done.returncode == 0, (
        f"{ex.where} exited {done.returncode}:\n{ex.code}\n---\n{out[-4000:]}"
    )
    if ex.expect is not None:
        assert ex.expect in out, f"{ex.where}: {ex.expect!r} not in its output:\n{out[-4000:]}"


@pytest.fixture
def background() -> Iterator[list[_Background]]:
    running: list[_Background] = []
    yield running
    for server in running:
        server.stop()


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_examples_run(
    page: Path, doc_env: dict[str, str], background: list[_Background], tmp_path: Path
) -> None:
    try:
        blocks = examples(page.read_text(), page.relative_to(ROOT).as_posix())
    except MarkerError as e:
        pytest.fail(str(e))
    for ex in blocks:
        if ex.kind == "skip":
            continue
        if ex.kind == "server":
            while background:
                background.pop().stop()
            assert not _port_8000_busy(), f"{ex.where}: port 8000 is already in use"
            server = _Background(ex, doc_env, tmp_path / f"server-{ex.line}.log")
            background.append(server)
            server.wait_healthy()
            continue
        _run(ex, doc_env)
