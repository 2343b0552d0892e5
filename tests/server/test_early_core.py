"""`ember serve` spawns its engine core before it imports torch or FastAPI, so that the two
processes start at once: the path up to the spawn must stay torch-free, and a start that fails
after the spawn must stop that core and free its sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_the_path_to_the_spawn_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import ember.cli, ember.cluster, ember.engine.core_spawn, ember.server.args\n"
        "import ember.engine.cuda_context, ember.kernels.triton_setup\n"
        "import ember.models.resolve, ember.trust, ember.kv.tiers.store_master\n"
        "import argparse\n"
        "from ember.server.args import add_serve_args, engine_config_from_args\n"
        "p = argparse.ArgumentParser(); add_serve_args(p)\n"
        "engine_config_from_args(p.parse_args(['m', '--speculative', 'ngram']), 's')\n"
        "heavy = sorted(m for m in ('torch', 'fastapi', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        # The names of the tiers package still load, lazily.
        "from ember.kv.tiers import HostTier, TierManager\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_the_api_process_imports_no_torch(tiny_model_dir) -> None:
    """The API process runs no model: its server module, the model's config and the engine's
    resolved config (what AsyncLLM reads) come without torch, which it used to import for ~1.3 s
    of CPU and a few hundred MB of memory beside the engine core's own."""
    path = tiny_model_dir("qwen3")
    code = (
        "import sys\n"
        "import ember.server.api_server, ember.engine.async_llm\n"
        "from ember.engine.config import EngineConfig\n"
        "from ember.models.config import ModelConfig\n"
        f"mc = ModelConfig.from_dir({str(path)!r})\n"
        f"r = EngineConfig(model={str(path)!r}, dtype='bf16').resolve(mc)\n"
        "assert r.dtype_name == 'bfloat16' and mc.dtype_name in ('float32', 'bfloat16'), r\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "assert r.dtype is torch.bfloat16 and mc.dtype is getattr(torch, mc.dtype_name)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_a_start_that_fails_after_the_spawn_stops_its_core(tiny_model_dir, tmp_path) -> None:
    """A missing API keys file is found after the core was spawned: serve exits 2 at once (not
    after the core has loaded), and leaves no IPC directory behind."""
    ipc = tmp_path / "tmp"
    ipc.mkdir()
    env = {**os.environ, "TMPDIR": str(ipc), "EMBER_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "ember.cli", "serve", str(tiny_model_dir("llama"))]
    cmd += ["--port", str(free_port()), "--api-keys-file", str(tmp_path / "missing")]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot read the API keys file" in done.stderr
    assert time.monotonic() - t0 < 60
    assert not list(ipc.glob("ember-ipc-*")), "the spawned core's IPC directory was left behind"


def _ipc_dirs(tmp: Path) -> list[Path]:
    return list(tmp.glob("ember-ipc-*"))


def test_serve_by_name_lists_it_once_and_a_stop_leaves_no_ipc_directory(smollm2, tmp_path) -> None:
    """`ember serve smollm2`: served as smollm2-135m-instruct (listed once, its own context of
    8,192), and SIGTERM leaves no IPC directory in $TMPDIR."""
    import httpx

    ipc = tmp_path / "tmp"
    ipc.mkdir()
    env = {**os.environ, "TMPDIR": str(ipc), "EMBER_LOG_LEVEL": "WARNING"}
    port = free_port()
    cmd = [sys.executable, "-m", "ember.cli", "serve", "smollm2", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--log-level", "warning"], cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert len(_ipc_dirs(ipc)) == 1  # the live server's sockets
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in listed] == [("smollm2-135m-instruct", 8192)]
        assert listed[0]["root"] == str(smollm2)
    finally:
        proc.terminate()
        proc.wait(60)  # 143: uvicorn drains, then raises the SIGTERM it captured again
    assert not _ipc_dirs(ipc), "a stopped server left its IPC directory behind"


def test_sigterm_during_start_up_leaves_no_ipc_directory(tiny_model_dir, tmp_path) -> None:
    """`ember up` stopped at once stops its engines while they start: the core was spawned, the
    server not yet serving (SIGTERM's default action used to leave the directory behind)."""
    ipc = tmp_path / "tmp"
    ipc.mkdir()
    env = {**os.environ, "TMPDIR": str(ipc), "EMBER_LOG_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "ember.cli", "serve", str(tiny_model_dir("llama"))]
    proc = subprocess.Popen([*cmd, "--port", str(free_port())], cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while not _ipc_dirs(ipc):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.terminate()
    proc.wait(60)
    assert not _ipc_dirs(ipc), "SIGTERM during start-up left the IPC directory behind"


def test_an_engine_core_start_and_stop_leave_no_ipc_directory(
    tiny_model_dir, tmp_path, monkeypatch
) -> None:
    import asyncio
    import tempfile

    from ember.engine.async_llm import AsyncLLM
    from ember.engine.config import EngineConfig

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    async def main() -> None:
        engine = AsyncLLM(EngineConfig(str(tiny_model_dir("llama")), max_model_len=256))
        await engine.start()
        assert len(_ipc_dirs(tmp_path)) == 1
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))
    assert not _ipc_dirs(tmp_path)


def test_a_killed_processs_ipc_directory_goes_at_the_next_spawn(tmp_path) -> None:
    from ember.engine.core_spawn import remove_stale_ipc_dirs

    dead = tmp_path / "ember-ipc-999999999-abcd"  # no such process
    live = tmp_path / f"ember-ipc-{os.getpid()}-abcd"
    unknown = tmp_path / "ember-ipc-abcd1234"  # no process id in the name: not ours to judge
    for d in (dead, live, unknown):
        d.mkdir()
        (d / "input").touch()
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and unknown.exists()
