"""The KV host tier of a tensor-parallel engine on the CPU (gloo, 2 processes): with a device pool
too small for two sessions, an agent's next turn is loaded from host memory on every rank (rank 0
decides, the other repeats its copies on its own heads), and its greedy tokens and logprobs equal
one process computing everything; after a restart it comes off every rank's own disk, and a rank
missing its blocks makes them a miss for all; another engine reads them from a shared store."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.config import EngineConfig
from ember.engine.kv_tiers import host_tier_bytes

BLOCK = 16
POOL = 48  # device blocks: one session of ~38 blocks fits, two do not
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)


def session(seed: int, n: int = 600) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


A, B = session(1), session(2)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")


def engine(model: Path, **kwargs: object) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        max_model_len=POOL * BLOCK,
        num_kv_blocks=POOL,
        cpu_threads=1,
        **kwargs,
    )


Answer = tuple[list[int], list[dict]]
"""Greedy tokens and their logprobs."""
Turns = tuple[Answer, list[int], Answer]
"""Session A's answer, its next turn's prompt, that turn's answer."""


def answer(llm: LLM, prompt: list[int]) -> Answer:
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    return list(out.token_ids), list(out.logprobs)


def assert_same(got: Answer, want: Answer) -> None:
    assert got[0] == want[0]
    for pos_g, pos_w in zip(got[1], want[1], strict=True):
        assert pos_g.keys() == pos_w.keys()
        for t in pos_w:
            assert abs(pos_g[t].logprob - pos_w[t].logprob) <= 1e-4


@pytest.fixture(scope="module")
def turns(model: Path) -> Turns:
    """One process, no cache: session A's answer, its next turn's prompt, and that turn's
    answer (tokens and logprobs), what every engine here must give."""
    reference = engine(model, enable_prefix_caching=False)
    try:
        a1 = answer(reference, A)
        a2_prompt = A + a1[0] + session(3, 20)
        return a1, a2_prompt, answer(reference, a2_prompt)
    finally:
        reference.close()


def test_next_turn_of_an_evicted_session_loads_from_host_on_two_ranks(
    model: Path, turns: Turns
) -> None:
    a1_want, a2_prompt, a2_want = turns
    llm = engine(model, kv_host_gb=0.05, tensor_parallel_size=2)
    core = llm.engine.core
    try:
        assert core.tiers is not None and core.tiers.replicas is not None
        assert_same(answer(llm, A), a1_want)
        answer(llm, B)  # takes most of A's device blocks, on both ranks
        hashes = core.kv.update_block_hashes([], a2_prompt, None)
        on_device = 0
        while core.kv.pool.get_cached_block(hashes[on_device]) is not None:
            on_device += 1
        known = (len(A) + GREEDY.max_tokens - 1) // BLOCK
        assert on_device < known - 4, "the device pool kept the session: nothing to show"
        out = llm.generate([a2_prompt], GREEDY)[0]
        # Every block turn 1 computed was reused, most of them from host memory: rank 1's heads
        # of those blocks came back from its own host memory, or its tokens would differ.
        assert out.num_cached_tokens == known * BLOCK
        host = core.stats().kv_tiers["cpu"]
        assert host.hits == known - on_device and host.loads == 1
        assert_same((list(out.outputs[0].token_ids), list(out.outputs[0].logprobs)), a2_want)
    finally:
        llm.close()


def test_restarted_engine_answers_the_next_turn_from_every_rank_s_disk(
    model: Path, turns: Turns, tmp_path: Path
) -> None:
    a1_want, a2_prompt, a2_want = turns
    disk = {"kv_disk_dir": str(tmp_path), "kv_disk_gb": 0.1, "tensor_parallel_size": 2}
    first = engine(model, **disk)
    assert_same(answer(first, A), a1_want)
    first.close()  # every rank's disk writes queued so far end before it returns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp2-rank0", "tp2-rank1"]

    again = engine(model, **disk)
    try:
        out = again.generate([a2_prompt], GREEDY)[0]
        stats = again.engine.core.stats().kv_tiers
        known = (len(A) + GREEDY.max_tokens - 1) // BLOCK
        assert stats["disk"].hits == known  # every block of turn 1 came off disk
        assert out.num_cached_tokens == known * BLOCK
        # Rank 1's heads came off its own disk, or its tokens would differ.
        assert_same((list(out.outputs[0].token_ids), list(out.outputs[0].logprobs)), a2_want)
    finally:
        again.close()


def test_a_rank_missing_its_blocks_makes_them_a_miss(
    model: Path, turns: Turns, tmp_path: Path
) -> None:
    """Rank 1's disk emptied between two runs: rank 0's index still holds the blocks, but a
    read counts only what every rank found, so the next turn is computed, and right."""
    a1_want, a2_prompt, a2_want = turns
    disk = {"kv_disk_dir": str(tmp_path), "kv_disk_gb": 0.1, "tensor_parallel_size": 2}
    first = engine(model, **disk)
    assert_same(answer(first, A), a1_want)
    first.close()
    blocks = list((tmp_path / "tp2-rank1").rglob("*.kv"))
    assert len(blocks) >= len(A) // BLOCK
    for f in blocks:
        f.unlink()
    again = engine(model, **disk)
    try:
        out = again.generate([a2_prompt], GREEDY)[0]
        assert again.engine.core.stats().kv_tiers["disk"].hits == 0
        assert_same((list(out.outputs[0].token_ids), list(out.outputs[0].logprobs)), a2_want)
    finally:
        again.close()


def test_each_rank_holds_its_share_of_the_host_tier() -> None:
    one = EngineConfig(model="m", kv_host_gb=8)
    four = EngineConfig(model="m", kv_host_gb=8, tensor_parallel_size=4)
    cpu = torch.device("cpu")
    assert host_tier_bytes(four, cpu) * 4 == host_tier_bytes(one, cpu) == 8 << 30


def test_another_engine_answers_from_every_rank_s_store_blocks(model: Path, turns: Turns) -> None:
    """Two engines of two ranks over one `mooncake_master`: a server that computes A and keeps
    running (the store's blocks live in the memory its ranks lend), then an engine here that
    reads them, each rank its own heads under names of its own."""
    pytest.importorskip("mooncake.store", reason="the Mooncake Store is not installed")
    from ember.kv.tiers.store_master import start_master
    from tests.servers import SECRET, start_server

    want = turns[0]
    master = start_master()
    writer = None
    try:
        common = ("--kv-store", master.address, "--kv-store-gb", "0.06", "-tp", "2")
        writer = start_server(
            model, *common, "--dtype", "float32", "--cpu-threads", "1", "--num-kv-blocks", "48",
            "--max-model-len", str(POOL * BLOCK),
        )  # fmt: skip
        body = {"model": "tiny", "prompt": A, "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{writer.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        known = len(A) // BLOCK
        reader = engine(
            model,
            kv_store=master.address,
            kv_store_gb=0.06,
            tensor_parallel_size=2,
            cluster_secret=SECRET,
        )
        try:
            (store_tier,) = reader.engine.core.tiers.lower.tiers
            assert store_tier.local.layout.model.endswith("|tp2-rank0")  # rank 1: "rank1"
            deadline = time.monotonic() + 30
            while store_tier.contains_prefix(reader_keys(reader, A)) < known - 1:
                assert time.monotonic() < deadline, "the writer's blocks never reached the store"
                time.sleep(0.2)
            out = reader.generate([A], GREEDY)[0]
            assert reader.engine.core.stats().kv_tiers["store"].hits >= known - 1
            assert out.num_cached_tokens >= (known - 1) * BLOCK
            assert_same((list(out.outputs[0].token_ids), list(out.outputs[0].logprobs)), want)
        finally:
            reader.close()
    finally:
        if writer is not None:
            writer.stop()
        master.stop()


def reader_keys(llm: LLM, prompt: list[int]) -> list[bytes]:
    """The block hashes the engine names the prompt's full blocks by."""
    return list(llm.engine.core.kv.update_block_hashes([], prompt, None))
