"""Faults of the engine core stay small: a request that raises in the core fails alone, a step that
raises fails its own batch, a dead core ends its `ember serve` (non-zero, for a supervisor), and a
core never outlives its API process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from ember.engine.async_llm import AsyncLLM
from ember.engine.config import EngineConfig
from ember.engine.core import MAX_FAILED_STEPS, EngineCore
from ember.engine.core_client import RequestFailedError
from ember.engine.messages import EngineCoreRequest
from ember.sampling_params import SamplingParams
from tests.servers import start_server


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def _config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), max_model_len=256, num_kv_blocks=64, cpu_threads=1)


# -- one request's error in the core ------------------------------------------------------------


def _top_k_overflow(p: SamplingParams) -> None:
    p.top_k = 2**63  # the sampler's int64 tensor overflows: the core died on it


def _stop_id_outside_vocab(p: SamplingParams) -> None:
    p.stop_token_ids, p.min_tokens = [2**62], 2  # blocked ids are range-checked inside a step


def _refused_on_decode(p: SamplingParams) -> None:
    p.top_k = -5  # SamplingParams refuses it when the core decodes the message


@pytest.mark.parametrize("spoil", [_top_k_overflow, _stop_id_outside_vocab, _refused_on_decode])
def test_request_that_raises_in_the_core_fails_alone(
    llama: Path, spoil: Callable[[SamplingParams], None]
) -> None:
    """Values the API edge should have refused reach the core anyway: that request fails with
    RequestFailedError, a request running beside it finishes, and the core serves on."""

    async def main() -> None:
        engine = AsyncLLM(_config(llama))
        await engine.start()
        process = engine.inputs.process

        def hostile(*args: object, **kw: object) -> tuple:
            state, reqs = process(*args, **kw)
            for r in reqs:
                spoil(r.sampling_params)
            return state, reqs

        try:
            ok = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            good = await engine.add_request("good", [5, 6, 7, 8], ok)
            engine.inputs.process = hostile  # type: ignore[method-assign]
            bad = await engine.add_request("bad", [9, 10, 11], SamplingParams(n=2, max_tokens=8))
            engine.inputs.process = process  # type: ignore[method-assign]
            with pytest.raises(RequestFailedError, match="engine error"):
                async for _ in bad:
                    pass
            outs = [o async for o in good]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40
            after = [o async for o in await engine.add_request("after", [1, 2, 3], ok)]
            assert after[-1].finished and engine.is_ready and engine.dead is None
            assert engine.num_unfinished == 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


# -- a step that raises ---------------------------------------------------------------------------


def _add(core: EngineCore, rid: str, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, prompt, params, [], 5))


def _run(core: EngineCore) -> dict[str, str | None]:
    finish: dict[str, str | None] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return finish


def test_failed_step_fails_its_batch_frees_and_unpublishes_its_blocks(llama: Path) -> None:
    core = EngineCore(_config(llama))
    pool = core.kv.pool
    free = pool.num_free_blocks
    launch = core.runner.launch
    calls = iter([True])

    def flaky(so):  # noqa: ANN001, ANN202 - ModelRunner.launch
        if next(calls, False):
            raise RuntimeError("device fault")
        return launch(so)

    core.runner.launch = flaky  # type: ignore[method-assign]
    prompt = list(range(10, 10 + 3 * core.config.block_size))
    _add(core, "a", prompt)
    _add(core, "b", prompt[::-1])
    assert _run(core) == {"a": "error", "b": "error"}
    # Their full blocks were published at scheduling, but the KV was never written.
    assert pool.num_free_blocks == free and pool.num_cached_blocks == 0
    _add(core, "c", prompt)
    assert _run(core) == {"c": "length"}
    assert core.stats().prefix_hits == 0  # c computed its prompt afresh


def test_a_core_whose_every_step_fails_gives_up(llama: Path) -> None:
    core = EngineCore(_config(llama))

    def broken(so):  # noqa: ANN001, ANN202
        raise RuntimeError("device lost")

    core.runner.launch = broken  # type: ignore[method-assign]
    for i in range(MAX_FAILED_STEPS - 1):
        _add(core, f"r{i}", [1, 2, 3])
        assert [o.finish_reason for o in core.step()] == ["error"]
    _add(core, "last", [1, 2, 3])
    with pytest.raises(RuntimeError, match="device lost"):
        core.step()


# -- processes ------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _core_pid(api_pid: int) -> int:
    for pid in _children(api_pid):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no engine-core process under {api_pid}")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has exited; its reaper may not have come yet


def _wait_gone(pid: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not _gone(pid):
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"process {pid} still alive after {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_dead_core_makes_the_server_exit_nonzero(llama: Path) -> None:
    server = start_server(llama)
    try:
        os.kill(_core_pid(server.proc.pid), signal.SIGKILL)
        t0 = time.monotonic()
        rc = server.proc.wait(15)  # the old server stayed up, answering 503 for good
        assert rc != 0
        assert time.monotonic() - t0 < 10
    finally:
        server.stop()


def test_sigkill_of_the_api_process_mid_stream_ends_the_core(llama: Path) -> None:
    server = start_server(llama)
    core = _core_pid(server.proc.pid)
    streaming = threading.Event()

    def stream() -> None:
        body = {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{server.base}/completions", json=body, timeout=30) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i == 3:
                        streaming.set()
        except httpx.HTTPError:
            pass  # the server is killed under it

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        assert streaming.wait(30), "the stream never started"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(5)
        assert _wait_gone(core, 2.0) < 2.0
    finally:
        if not _gone(core):
            os.kill(core, signal.SIGKILL)
        server.stop()
        reader.join(10)


# -- a prefill lease nobody will read --------------------------------------------------------------


def test_abort_after_a_prefill_finished_releases_its_lease(llama: Path) -> None:
    """The API aborts a prefill it never saw finish (its client left as the core finished it): the
    lease the core took reached no one, so the abort frees it at once instead of at expiry."""
    from ember.kv_transfer_params import KVTransferParams

    cfg = EngineConfig(
        model=str(llama), max_model_len=256, num_kv_blocks=64, cpu_threads=1, kv_role="prefill"
    )
    core = EngineCore(cfg)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        kv = KVTransferParams(do_remote_decode=True)
        core.add_request(EngineCoreRequest("p1", list(range(3, 40)), params, [], 1, kv_transfer=kv))
        outs = [o for _ in range(20) if core.has_unfinished_requests() for o in core.step()]
        assert any(o.kv_transfer_params is not None for o in outs)
        assert core.stats().num_leases == 1
        core.abort_requests(["p1"])
        assert core.stats().num_leases == 0
        assert core.stats().num_free_blocks == core.num_kv_blocks
    finally:
        core.close()
