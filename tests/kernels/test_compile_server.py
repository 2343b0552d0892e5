"""The Triton compile server (ember/kernels/compile_server.py): a variant met by a dry run
compiles in the server's worker processes, and the engine's own compile of it then finds it in
Triton's on-disk cache (the keys agree); a failed or gone server leaves the compile to the
engine. Run without a GPU: a stub driver names an H100 as the target (Triton compiles for it with
its own ptxas, no GPU needed), in a subprocess without TRITON_INTERPRET (the test session's
kernels are interpreted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class StubDriver:  # an H100 for the compiler; nothing is launched
        def get_current_device(self):
            return 0
        def get_current_stream(self, device):
            return 0
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(StubDriver())

    from ember.kernels import compile_log
    from ember.kernels.compile_server import CompileServer
    from ember.kernels.precompile import precompile
    from ember.kernels.rmsnorm import rms_norm

    mode = sys.argv[1]
    hits = []
    log = compile_log.CompileLog()

    def listen(**kw):
        hits.append(kw["cache_hit"])
        log(**kw)

    knobs.compilation.listener = listen
    server = CompileServer.start(2)
    if mode == "dead":
        server.close(wait=True)
    elif mode == "bad-module":
        from ember.kernels import compile_server
        compile_server.kernel_address = lambda kernel: ("ember.no_such_module", "k")

    x = torch.randn(4, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    if mode == "lookup":
        from ember.kernels.compile_server import compile_variant, in_cache, variant_source
        from ember.kernels.precompile import recording

        with recording() as found:
            rms_norm(x, w, 1e-6)
        (kernel, data), = found.values()
        target = GPUTarget("cuda", 90, 32)
        src, options = variant_source(kernel, data, target)
        before = in_cache(src, target, options)
        compile_variant(kernel.__module__, kernel.fn.__name__, data, ["cuda", 90, 32])
        print(json.dumps({"before": before, "after": in_cache(src, target, options)}))
        sys.exit(0)
    done = precompile(lambda: rms_norm(x, w, 1e-6), workers=2, server=server)
    server.close(wait=True)
    print(json.dumps({
        "variants": done.variants, "hits": hits, "compiled": log.compiled,
        "loaded": log.loaded, "compile_s": log.compile_s,
    }))
    """
)


def _run(mode: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_variant_compiles_in_the_server_and_the_engine_only_loads_it(tmp_path: Path) -> None:
    out = _run("server", tmp_path)
    assert out["variants"] == 1
    # The engine's compile found the server's binary: a cache hit, counted as compiled (by the
    # server, in its seconds), not as loaded.
    assert out["hits"] == [True]
    assert (out["compiled"], out["loaded"]) == (1, 0)
    assert out["compile_s"] > 0
    # A second start on the same cache: the server finds it too, nothing is compiled.
    again = _run("server", tmp_path)
    assert again["hits"] == [True]
    assert (again["compiled"], again["loaded"]) == (0, 1)


def test_the_cache_lookup_finds_what_the_worker_compiled(tmp_path: Path) -> None:
    assert _run("lookup", tmp_path) == {"before": False, "after": True}


def test_a_dead_server_leaves_the_compile_to_the_engine(tmp_path: Path) -> None:
    out = _run("dead", tmp_path)
    assert out["variants"] == 1
    assert out["hits"] == [False]  # compiled in the engine's own thread
    assert (out["compiled"], out["loaded"]) == (1, 0)


def test_a_job_the_server_fails_is_compiled_by_the_engine(tmp_path: Path) -> None:
    out = _run("bad-module", tmp_path)
    assert out["hits"] == [False]
    assert (out["compiled"], out["loaded"]) == (1, 0)


def test_the_server_answers_a_malformed_line_and_goes_on(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    bad_module = {"id": 4, "module": "ember.no_such_module", "name": "k", "data": "{}"}
    lines = ["not json", json.dumps({"id": 3}), json.dumps({**bad_module, "target": []})]
    done = subprocess.run(
        [sys.executable, "-m", "ember.kernels.compile_server", "1"],
        input="\n".join(lines) + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert "ready" in lines[0]  # the workers forked, before any job
    answers = lines[1:]
    assert len(answers) == 3
    assert all("error" in a for a in answers)
    assert {a["id"] for a in answers} == {-1, 4}
    assert "ModuleNotFoundError" in next(a["error"] for a in answers if a["id"] == 4)


@pytest.mark.gpu
def test_on_a_gpu_the_servers_variant_launches_and_computes_the_reference() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from triton import knobs

    from ember.kernels.compile_server import CompileServer
    from ember.kernels.precompile import precompile
    from ember.kernels.rmsnorm import rms_norm

    x = torch.randn(5, 3, 48, dtype=torch.bfloat16, device="cuda")  # a shape no other test uses
    w = torch.randn(48, dtype=torch.bfloat16, device="cuda")
    hits: list[bool] = []
    previous = knobs.compilation.listener

    def listen(**kw) -> None:
        hits.append(kw["cache_hit"])
        if previous is not None:
            previous(**kw)

    server = CompileServer.start(2)
    knobs.compilation.listener = listen
    try:
        done = precompile(lambda: rms_norm(x, w, 1e-6), workers=2, server=server)
    finally:
        knobs.compilation.listener = previous
        server.close(wait=True)
    assert done.variants == 1
    assert hits == [True]  # the server's binary, found in the cache
    out = rms_norm(x, w, 1e-6)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(out, normed * w, rtol=2e-2, atol=2e-2)


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    members.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile
    return members


def test_a_stopped_server_leaves_no_process_behind() -> None:
    import time

    from ember.kernels.compile_server import CompileServer

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    server = CompileServer.start(2, env=env)
    deadline = time.monotonic() + 120
    while server.ready_at is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.ready_at is not None
    assert len(_session_members(server.proc.pid)) == 3  # the server and its two workers
    server.close()  # returns at once; a thread reaps it
    deadline = time.monotonic() + 30
    while _session_members(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_members(server.proc.pid) == []
    assert server.proc.wait(timeout=10) == 0
