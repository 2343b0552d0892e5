"""Disaggregation with data-parallel attention (CPU, float32, tiny DeepSeek-V3): a prefill engine
of two ranks each caching its own requests (`ember serve --role prefill -tp 2
--enable-dp-attention`) leases a prompt's blocks from the one rank that holds them, whole, and
decode engines of one rank and of two data-parallel ranks (the one rank a request lives on
reading it) answer with one colocated engine's tokens, over shared memory and over Mooncake
(each lease's blocks tagged by the rank that holds them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from ember.engine.core import EngineCore
from tests.engine.test_pd_tensor_parallel import (
    NEW_TOKENS,
    PROMPTS,
    _add,
    _config,
    _run,
    colocated_tokens,
    server_leases,
)
from tests.servers import SECRET, Server, start_server

DP = ("--tensor-parallel-size", "2", "--enable-expert-parallel", "--enable-dp-attention")


@pytest.fixture(scope="module")
def deepseek(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def colocated(deepseek: Path) -> dict[str, list[int]]:
    return colocated_tokens(deepseek)


@pytest.fixture(scope="module", params=["shm", "mooncake"])
def prefill(request: pytest.FixtureRequest, deepseek: Path) -> Iterator[tuple[Server, str]]:
    transport = request.param
    if transport == "mooncake":
        pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is missing")
    server = start_server(
        deepseek, "--role", "prefill", "--kv-transport", transport, *DP,
        "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
        "--cpu-threads", "1",
    )  # fmt: skip
    yield server, transport
    server.stop()


def _decode_all(server: Server, decode: EngineCore, tag: str) -> dict[str, list[int]]:
    leases = server_leases(server)
    # Each lease names the one rank holding its blocks; the prompts went to both ranks.
    assert all(len(lease.peers) == 1 for lease in leases)
    assert len({lease.transfer_address for lease in leases}) == 2
    for i, (p, lease) in enumerate(zip(PROMPTS, leases, strict=True)):
        kv = msgspec.structs.replace(lease, do_remote_prefill=True, do_remote_decode=False)
        _add(decode, f"{tag}{i}", p, NEW_TOKENS, kv, tag)
    rest = _run(decode)
    load = server.load()
    assert load["leases"] == 0 and load["free_blocks"] == load["total_blocks"]
    return {f"r{i}": [lease.first_token_id] + rest[f"{tag}{i}"] for i, lease in enumerate(leases)}


@pytest.mark.parametrize("decode_dp", [False, True], ids=["one-rank", "dp2"])
def test_decode_engines_read_the_rank_that_holds_the_blocks(
    prefill: tuple[Server, str],
    deepseek: Path,
    colocated: dict[str, list[int]],
    decode_dp: bool,
) -> None:
    server, transport = prefill
    extra = (
        {"tensor_parallel_size": 2, "enable_expert_parallel": True, "enable_dp_attention": True}
        if decode_dp
        else {}
    )
    decode = EngineCore(
        _config(deepseek, kv_role="decode", kv_transport=transport, cluster_secret=SECRET, **extra)
    )
    try:
        assert _decode_all(server, decode, f"{transport}-{decode_dp}") == colocated
        stats = decode.stats()
        assert stats.remote_kv_loads == len(PROMPTS) and stats.remote_kv_failures == 0
        assert stats.num_free_blocks == stats.num_blocks
        if decode_dp:  # the decode engine's requests lived on both of its ranks too
            kv = decode.kv
            assert all(m.pool.num_cached_blocks > 0 for m in kv.ranks)  # type: ignore[union-attr]
    finally:
        decode.close()
