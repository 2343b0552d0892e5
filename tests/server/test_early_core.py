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
