"""Disaggregation between tensor-parallel engines over Mooncake (CPU, TCP, float32): a prefill
engine of two ranks (`ember serve --role prefill -tp 2 --kv-transport mooncake`) tags each
rank's share of every leased block under a key of its own, and a decode engine of two ranks
reads and checks its share on each rank. Its tokens equal one colocated engine's. A forged tag
of either rank, or a decode engine whose ranks hold other heads (one rank), falls back to
prefilling here with the same tokens."""

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

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def colocated(llama: Path) -> dict[str, list[int]]:
    return colocated_tokens(llama)


@pytest.fixture(scope="module")
def prefill(llama: Path) -> Iterator[Server]:
    server = start_server(
        llama,
        "--role", "prefill", "--kv-transport", "mooncake", "--tensor-parallel-size", "2",
        "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
        "--cpu-threads", "1",
    )  # fmt: skip
    yield server
    server.stop()


def _mooncake_decode(llama: Path, size: int) -> EngineCore:
    return EngineCore(
        _config(
            llama,
            kv_role="decode",
            kv_transport="mooncake",
            tensor_parallel_size=size,
            cluster_secret=SECRET,
        )
    )


def _decode_all(
    server: Server, decode: EngineCore, tag: str, forge: int | None = None
) -> dict[str, list[int]]:
    """Each prompt prefilled by the server and decoded here; `forge`: that rank's first tag of
    every lease altered on the way."""
    leases = server_leases(server)
    for lease in leases:
        tags = lease.all_block_tags
        assert len(tags) == 2 and all(len(t) == len(lease.block_ids) for t in tags)
        assert tags[0] != tags[1]  # each rank tags its own bytes under its own key
    for i, (p, lease) in enumerate(zip(PROMPTS, leases, strict=True)):
        kv = msgspec.structs.replace(lease, do_remote_prefill=True, do_remote_decode=False)
        if forge is not None:
            tags = [list(t) for t in kv.all_block_tags]
            head, _, hexed = tags[forge][0].partition(":")
            tags[forge][0] = f"{head}:{'0' if hexed[0] != '0' else '1'}{hexed[1:]}"
            kv = msgspec.structs.replace(kv, block_tags=tags[0], rank_block_tags=tags[1:])
        _add(decode, f"{tag}{i}", p, NEW_TOKENS, kv, tag)
    rest = _run(decode)
    load = server.load()
    assert load["leases"] == 0 and load["free_blocks"] == load["total_blocks"]
    return {f"r{i}": [lease.first_token_id] + rest[f"{tag}{i}"] for i, lease in enumerate(leases)}


def test_two_rank_engines_move_tagged_kv(
    prefill: Server, llama: Path, colocated: dict[str, list[int]]
) -> None:
    decode = _mooncake_decode(llama, 2)
    try:
        assert _decode_all(prefill, decode, "ok") == colocated
        stats = decode.stats()
        assert stats.remote_kv_loads == len(PROMPTS) and stats.remote_kv_failures == 0
        assert decode.connector is not None and decode.connector.tag_failures == 0
        for rank in (0, 1):
            before = decode.stats()
            assert _decode_all(prefill, decode, f"forged{rank}", forge=rank) == colocated
            after = decode.stats()
            assert after.remote_kv_failures - before.remote_kv_failures == len(PROMPTS)
            assert after.remote_kv_loads == before.remote_kv_loads
        # Rank 0's forged tags are caught on rank 0; rank 1's on its worker.
        assert decode.connector.tag_failures == len(PROMPTS)
    finally:
        decode.close()


def test_a_decode_engine_of_another_size_prefills_here(
    prefill: Server, llama: Path, colocated: dict[str, list[int]]
) -> None:
    """One rank would read two prefill ranks' halves of each block, whose tags cover only
    whole shares: it refuses the read and computes the prompt itself."""
    decode = _mooncake_decode(llama, 1)
    try:
        assert _decode_all(prefill, decode, "one") == colocated
        stats = decode.stats()
        assert stats.remote_kv_loads == 0 and stats.remote_kv_failures == len(PROMPTS)
    finally:
        decode.close()
