"""A decode engine of two ranks reads a prompt's KV from a prefill engine of one (CPU, shared
memory, float32): each rank its own heads of every block. The tokens equal one colocated engine's;
a read that fails on a worker only makes rank 0 prefill the prompt itself (same tokens, every
block freed, the lease released); a tensor-parallel prefill engine, or Mooncake under a
tensor-parallel decode engine, is refused at start."""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest
import torch

from ember import LLM
from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.engine.step_plan import LoadKV
from ember.kv.transport import ShardLayout
from ember.kv_transfer_params import KVTransferParams
from ember.sampling_params import SamplingParams

PROMPTS = [
    list(range(3, 40)),  # a few blocks, the last one partial
    [7, 8, 9, 10, 11] * 7,
    list(range(100, 116)),  # exactly one block
]
NEW_TOKENS = 8
LEASES: dict[str, KVTransferParams] = {}
"""The prefill engine's answers' params, by request id."""
LEASED_BYTES: dict[str, int] = {}
"""The bytes of the blocks each run's leases offered, by its tag (every rank's heads)."""


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")


def _config(model: Path, **kw: object) -> EngineConfig:
    base = {"max_model_len": 256, "num_kv_blocks": 64, "cpu_threads": 1, "dtype": "float32"}
    return EngineConfig(model=str(model), **{**base, **kw})  # type: ignore[arg-type]


def _add(
    core: EngineCore,
    rid: str,
    prompt: list[int],
    n: int,
    kv: KVTransferParams | None,
    salt: str | None = None,
) -> None:
    """`salt`: a test's own prefix cache (no block read by an earlier test is a hit here)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, prompt, params, [], n, cache_salt=salt, kv_transfer=kv))


def _run(core: EngineCore) -> dict[str, list[int]]:
    """Every request's tokens (and, on a prefill engine, its lease's params as `kv`)."""
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.kv_transfer_params is not None:
                LEASES[out.request_id] = out.kv_transfer_params
    assert not core.has_unfinished_requests()
    return tokens


class _Releases:
    """The prefill engine's /kv/release, as its API process would answer it (the prefill core
    steps on this test's thread only between the decode engine's runs)."""

    def __init__(self, core: EngineCore) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                released = outer.core.release_lease(body["lease_id"])
                data = json.dumps({"released": released}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.core = core
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/kv/release"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def colocated(llama: Path) -> dict[str, list[int]]:
    core = EngineCore(_config(llama))
    try:
        for i, p in enumerate(PROMPTS):
            _add(core, f"r{i}", p, NEW_TOKENS, None)
        return _run(core)
    finally:
        core.close()


@pytest.fixture(scope="module")
def prefill(llama: Path) -> Iterator[tuple[EngineCore, _Releases]]:
    core = EngineCore(_config(llama, kv_role="prefill", kv_transport="shm"))
    releases = _Releases(core)
    yield core, releases
    releases.close()
    core.close()


@pytest.fixture(scope="module")
def decode(llama: Path) -> Iterator[EngineCore]:
    core = EngineCore(_config(llama, kv_role="decode", kv_transport="shm", tensor_parallel_size=2))
    yield core
    core.close()


def _disaggregated(
    prefill: tuple[EngineCore, _Releases], decode: EngineCore, tag: str
) -> dict[str, list[int]]:
    """Each prompt prefilled there (its first token) and decoded here, with the lease's KV."""
    pcore, releases = prefill
    for i, p in enumerate(PROMPTS):
        _add(pcore, f"{tag}{i}", p, 1, KVTransferParams(do_remote_decode=True), tag)
    first = _run(pcore)
    assert pcore.stats().num_leases == len(PROMPTS)
    for i, p in enumerate(PROMPTS):
        lease = LEASES.pop(f"{tag}{i}")
        LEASED_BYTES[tag] = LEASED_BYTES.get(tag, 0) + len(lease.block_ids) * lease.block_bytes
        kv = msgspec.structs.replace(
            lease, do_remote_prefill=True, do_remote_decode=False, release_url=releases.url
        )
        _add(decode, f"{tag}{i}", p, NEW_TOKENS, kv, tag)
    rest = _run(decode)
    assert pcore.stats().num_leases == 0  # every lease released, read or not
    assert pcore.stats().num_free_blocks == pcore.num_kv_blocks
    assert decode.stats().num_free_blocks == decode.num_kv_blocks
    # The decode engine goes on from the prefill engine's first token (not sent again).
    return {f"r{i}": first[f"{tag}{i}"] + rest[f"{tag}{i}"] for i in range(len(PROMPTS))}


def test_shard_layout_reads_each_ranks_heads() -> None:
    """Rank r's regions of a full-heads block are exactly its slice of the heads."""
    full = torch.randn(5, 2, 2, 4, 4, 3)  # [blocks, layers, planes, block_size, heads, dim]
    for size in (1, 2, 4):
        local_heads = 4 // size
        for rank in range(size):
            layout = ShardLayout(2 * 2 * 4, 4, local_heads, rank * local_heads, 3 * 4)
            mine = torch.zeros(5, 2, 2, 4, local_heads, 3)
            src, dst = [3, 4, 0], [1, 2, 4]
            for s, d, n in zip(
                *layout.pairs(full.data_ptr(), mine.data_ptr(), src, dst), strict=True
            ):
                ctypes.memmove(d, s, n)
            heads = slice(rank * local_heads, (rank + 1) * local_heads)
            assert torch.equal(mine[dst], full[src][..., heads, :])
            assert not mine[[0, 3]].any()


def test_two_rank_decode_engine_reads_its_heads_and_matches_one_engine(
    prefill: tuple[EngineCore, _Releases], decode: EngineCore, colocated: dict[str, list[int]]
) -> None:
    before = decode.stats()
    got = _disaggregated(prefill, decode, "ok")
    assert got == colocated
    after = decode.stats()
    assert after.remote_kv_loads - before.remote_kv_loads == len(PROMPTS)
    assert after.remote_kv_failures == before.remote_kv_failures
    # every rank's share counted, not rank 0's alone: the whole blocks, once
    assert after.remote_kv_bytes - before.remote_kv_bytes == LEASED_BYTES["ok"]
    assert after.remote_kv_seconds > before.remote_kv_seconds


def test_a_read_failed_on_a_worker_is_prefilled_here(
    prefill: tuple[EngineCore, _Releases], decode: EngineCore, colocated: dict[str, list[int]]
) -> None:
    """The workers are told an address outside the prefill engine's memory: rank 0's own read
    and the lease's release succeed, the load fails all the same."""
    workers = decode.workers
    assert workers is not None
    send = workers.send

    def corrupt(msg):  # type: ignore[no-untyped-def]
        if isinstance(msg, LoadKV):
            msg = msgspec.structs.replace(msg, remote_base=msg.remote_base + (1 << 44))
        send(msg)

    workers.send = corrupt  # type: ignore[method-assign]
    before = decode.stats()
    try:
        got = _disaggregated(prefill, decode, "bad")
    finally:
        workers.send = send  # type: ignore[method-assign]
    assert got == colocated
    after = decode.stats()
    assert after.remote_kv_failures - before.remote_kv_failures == len(PROMPTS)
    assert after.remote_kv_loads == before.remote_kv_loads
    assert after.remote_kv_bytes == before.remote_kv_bytes  # a failed load moved nothing usable
    assert workers.kv_loads == {}  # every rank's verdict heard


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kv_role": "prefill", "kv_transport": "shm"}, "kv_role 'prefill'.*one rank"),
        ({"kv_role": "decode", "kv_transport": "mooncake"}, "kv_transport 'mooncake'"),
    ],
)
def test_refused_roles(llama: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(llama), dtype="float32", tensor_parallel_size=2, **kwargs)
