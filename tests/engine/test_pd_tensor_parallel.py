"""Disaggregation with tensor-parallel engines (CPU, shared memory, float32). A decode engine of
two ranks reads a prompt's KV from a prefill engine of one, and decode engines of one and two
ranks from a prefill engine of two (`ember serve --role prefill -tp 2`): each rank its own heads
of every block, from the prefill ranks that hold them. The tokens equal one colocated engine's;
a read that fails on a worker only makes rank 0 prefill the prompt itself (same tokens, every
block freed, the lease released). Over Mooncake: tests/engine/test_pd_tensor_parallel_mooncake.py."""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from ember.distributed.shard import shard_heads
from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.kv_connector import ShardMap
from ember.engine.messages import EngineCoreRequest
from ember.engine.step_plan import LoadKV
from ember.kv.transport import ShardLayout
from ember.kv_transfer_params import KVTransferParams
from ember.sampling_params import SamplingParams
from ember.trust import internal_headers
from tests.servers import SECRET, Server, start_server

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


def server_leases(server: Server) -> list[KVTransferParams]:
    """Each prompt prefilled by an `ember serve --role prefill` server: its lease's params."""
    out = []
    for p in PROMPTS:
        body = {
            "model": "tiny", "prompt": p, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        }  # fmt: skip
        r = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=internal_headers(SECRET), timeout=60
        )
        r.raise_for_status()
        out.append(msgspec.convert(r.json()["kv_transfer_params"], KVTransferParams))
    return out


def colocated_tokens(model: Path) -> dict[str, list[int]]:
    """PROMPTS' greedy tokens from one colocated engine: what every disaggregated run equals."""
    core = EngineCore(_config(model))
    try:
        for i, p in enumerate(PROMPTS):
            _add(core, f"r{i}", p, NEW_TOKENS, None)
        return _run(core)
    finally:
        core.close()


@pytest.fixture(scope="module")
def colocated(llama: Path) -> dict[str, list[int]]:
    return colocated_tokens(llama)


@pytest.fixture(scope="module")
def prefill(llama: Path) -> Iterator[tuple[EngineCore, _Releases]]:
    core = EngineCore(_config(llama, kv_role="prefill", kv_transport="shm"))
    releases = _Releases(core)
    yield core, releases
    releases.close()
    core.close()


@pytest.fixture(scope="module")
def decode(llama: Path) -> Iterator[EngineCore]:
    core = EngineCore(
        _config(
            llama,
            kv_role="decode",
            kv_transport="shm",
            tensor_parallel_size=2,
            cluster_secret=SECRET,
        )
    )
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
            msg = msgspec.structs.replace(
                msg, remote_bases=[b + (1 << 44) for b in msg.remote_bases]
            )
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


def heads_of(num_heads: int, num_kv: int):  # type: ignore[no-untyped-def]
    def of(rank: int, size: int) -> tuple[int, int]:
        shard = shard_heads(num_heads, num_kv, rank, size)
        return shard.kv_head_start, shard.num_kv_heads

    return of


@pytest.mark.parametrize("num_kv", [4, 2])
@pytest.mark.parametrize("src_size,dst_size", [(2, 1), (2, 2), (1, 4), (2, 4), (4, 2), (4, 1)])
def test_each_rank_reads_its_heads_from_the_prefill_ranks_that_hold_them(
    num_kv: int, src_size: int, dst_size: int
) -> None:
    """A model of 4 query heads and `num_kv` KV heads: a prefill engine of `src_size` ranks holds
    them split (or, past their number, one a rank), and each rank of a decode engine of
    `dst_size` reads exactly its heads of the blocks asked for, nothing else."""
    of = heads_of(4, num_kv)
    full = torch.randn(5, 2, 2, 4, num_kv, 3)  # [blocks, layers, planes, block_size, heads, dim]
    src = []
    for p in range(src_size):
        start, n = of(p, src_size)
        src.append(full[..., start : start + n, :].contiguous())
    src_ids, dst_ids = [3, 4, 0], [1, 2, 4]
    for rank in range(dst_size):
        start, n = of(rank, dst_size)
        shards = ShardMap(2 * 2 * 4, 3 * 4, of, rank, dst_size)
        mine = torch.zeros(5, 2, 2, 4, n, 3)
        assert shards.remote_block_bytes(src_size) == src[0][0].numel() * 4
        for p, layout in shards.rank_layouts(src_size):
            pairs = layout.pairs(src[p].data_ptr(), mine.data_ptr(), src_ids, dst_ids)
            for a, b, length in zip(*pairs, strict=True):
                ctypes.memmove(b, a, length)
        assert torch.equal(mine[dst_ids], full[src_ids][..., start : start + n, :])
        assert not mine[[0, 3]].any()
        # A run of heads held by one prefill rank is one layout, not one a head.
        assert len(shards.rank_layouts(src_size)) == len(
            {p for p, _ in shards.rank_layouts(src_size)}
        )


@pytest.fixture(scope="module")
def tp_prefill(llama: Path) -> Iterator[Server]:
    server = start_server(
        llama,
        "--role", "prefill", "--kv-transport", "shm", "--tensor-parallel-size", "2",
        "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
    )  # fmt: skip
    yield server
    server.stop()


def _from_tp_prefill(server: Server, decode: EngineCore, tag: str) -> dict[str, list[int]]:
    """Each prompt prefilled by the two-rank server (its first token) and decoded here."""
    leases = server_leases(server)
    first = {f"{tag}{i}": [lease.first_token_id] for i, lease in enumerate(leases)}
    for lease in leases:
        assert len(lease.peers) == 2  # both ranks' caches are named
        assert lease.peers[0] != lease.peers[1]
    for i, p in enumerate(PROMPTS):
        kv = msgspec.structs.replace(leases[i], do_remote_prefill=True, do_remote_decode=False)
        _add(decode, f"{tag}{i}", p, NEW_TOKENS, kv, tag)
    rest = _run(decode)
    load = server.load()
    assert load["leases"] == 0 and load["free_blocks"] == load["total_blocks"]
    return {f"r{i}": first[f"{tag}{i}"] + rest[f"{tag}{i}"] for i in range(len(PROMPTS))}


def test_decode_engines_of_one_and_two_ranks_read_a_two_rank_prefill_engine(
    tp_prefill: Server, decode: EngineCore, llama: Path, colocated: dict[str, list[int]]
) -> None:
    before = decode.stats()
    assert _from_tp_prefill(tp_prefill, decode, "tp") == colocated
    after = decode.stats()
    assert after.remote_kv_loads - before.remote_kv_loads == len(PROMPTS)
    assert after.remote_kv_failures == before.remote_kv_failures
    one = EngineCore(_config(llama, kv_role="decode", kv_transport="shm", cluster_secret=SECRET))
    try:
        assert _from_tp_prefill(tp_prefill, one, "one") == colocated
        stats = one.stats()
        assert stats.remote_kv_loads == len(PROMPTS) and stats.remote_kv_failures == 0
    finally:
        one.close()
