"""Data-parallel attention on the CPU (gloo, 2 and 4 processes): a multi-head latent attention
model whose ranks attend to their own requests over caches of their own, the MoE layers split by
expert, gives one process's greedy tokens and logprobs (float32, 1e-4), through chunked prefill,
prefix-cache hits, preemption and ngram speculation; settings that would move a request's KV
by heads or to another engine are refused."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ember import LLM
from ember.kv.data_parallel import DataParallelKV
from ember.spec_decode.config import SpeculativeConfig
from tests.engine.test_tensor_parallel import (
    PROMPTS,
    assert_same,
    gone,
    greedy,
    outputs,
    worker_pids,
)

DP = {"tensor_parallel_size": 2, "enable_expert_parallel": True, "enable_dp_attention": True}


@pytest.fixture(scope="module")
def deepseek(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def want(deepseek: Path) -> list[tuple[list, list]]:
    one = LLM(str(deepseek), dtype="float32")
    try:
        return outputs(one, PROMPTS, greedy(16))
    finally:
        one.close()


@pytest.fixture(scope="class")
def two(deepseek: Path) -> Iterator[LLM]:
    llm = LLM(str(deepseek), dtype="float32", **DP)
    yield llm
    pids = worker_pids(llm)
    llm.close()
    assert all(gone(p) for p in pids)


def rank_caches(llm: LLM) -> DataParallelKV:
    kv = llm.engine.core.kv
    assert isinstance(kv, DataParallelKV)
    return kv


class TestTwoRanks:
    """One engine of two ranks for these (one tensor-parallel engine a process at a time)."""

    def test_two_ranks_equal_one(self, two: LLM, want: list) -> None:
        assert_same(outputs(two, PROMPTS, greedy(16)), want)
        kv = rank_caches(two)
        # Both ranks served requests: each cache holds prompts' blocks of its own.
        assert all(m.pool.num_cached_blocks > 0 for m in kv.ranks)
        assert kv.pool.num_free_blocks == kv.pool.num_blocks

    def test_prefix_hits_return_to_their_rank(self, two: LLM, want: list) -> None:
        s = two.engine.core.scheduler
        outputs(two, PROMPTS, greedy(16))
        hits = s.prefix_hits
        got = two.generate(PROMPTS, greedy(16))
        assert_same([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got], want)
        # The same prompts again: each found its prefix, which lives on one rank.
        assert s.prefix_hits > hits
        assert all(o.num_cached_tokens > 0 for o in got if len(o.prompt_token_ids) > 16)


def test_chunked_prefill_and_preemption(deepseek: Path) -> None:
    # Four prompts of ~40 tokens growing by 24, in chunks of 8 tokens, and 20 blocks of 4 tokens
    # a rank: two sequences a rank cannot both finish without one giving way.
    prompts = [f"{w} " * 12 + "and so on" for w in ("one", "two", "three", "four")]
    one = LLM(str(deepseek), dtype="float32")
    want = outputs(one, prompts, greedy(24))
    one.close()
    tight = LLM(
        str(deepseek),
        dtype="float32",
        max_num_batched_tokens=8,
        block_size=4,
        num_kv_blocks=20,
        max_model_len=80,
        **DP,
    )
    try:
        assert_same(outputs(tight, prompts, greedy(24)), want)
        assert tight.engine.core.scheduler.num_preemptions > 0
        kv = rank_caches(tight)
        assert kv.pool.num_blocks == 40
        assert kv.pool.num_free_blocks == 40
    finally:
        tight.close()


def test_ngram_speculation(deepseek: Path, want: list) -> None:
    spec = LLM(
        str(deepseek),
        dtype="float32",
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=4),
        **DP,
    )
    try:
        got = outputs(spec, PROMPTS, greedy(16))
        assert [t for t, _ in got] == [t for t, _ in want]
    finally:
        spec.close()


def test_four_ranks_equal_one(deepseek: Path, want: list) -> None:
    four = LLM(str(deepseek), dtype="float32", **{**DP, "tensor_parallel_size": 4})
    try:
        assert len(worker_pids(four)) == 3
        assert_same(outputs(four, PROMPTS, greedy(16)), want)
        # Four prompts, placed one a rank on empty caches.
        assert all(m.pool.num_cached_blocks > 0 for m in rank_caches(four).ranks)
    finally:
        pids = worker_pids(four)
        four.close()
    assert all(gone(p) for p in pids)


def test_kimi_without_expert_parallel(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A plain q projection (no q LoRA), the MoE split by width."""
    model = str(tiny_model_dir("kimi_k2"))
    one = LLM(model, dtype="float32")
    want = outputs(one, PROMPTS, greedy(12))
    one.close()
    two = LLM(model, dtype="float32", tensor_parallel_size=2, enable_dp_attention=True)
    try:
        assert_same(outputs(two, PROMPTS, greedy(12)), want)
    finally:
        two.close()


def test_one_rank_runs_the_same_code(deepseek: Path, want: list) -> None:
    one = LLM(str(deepseek), dtype="float32", enable_dp_attention=True)
    try:
        assert_same(outputs(one, PROMPTS, greedy(16)), want)
        assert len(rank_caches(one).ranks) == 1
    finally:
        one.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kv_host_gb": 0.1}, "kv_host_gb is not supported with enable_dp_attention"),
        ({"kv_disk_dir": "/tmp/unused"}, "kv_disk_dir is not supported"),
        ({"kv_store": "127.0.0.1:1"}, "kv_store is not supported"),
    ],
)
def test_refused_settings(deepseek: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(deepseek), dtype="float32", **{**DP, **kwargs})


def test_models_without_latent_attention_are_refused(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="needs a model with multi-head latent attention"):
        LLM(str(tiny_model_dir("qwen3_moe")), dtype="float32", **DP)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_one_gpu_runs_the_same_code(deepseek: Path, eager: bool) -> None:
    """One GPU through the data-parallel attention's path (its eager share of a step, or its
    decode graphs' rows made its own), plain decode and ngram verification, equals the plain
    engine."""
    kwargs = {
        "device": "cuda",
        "dtype": "float32",
        "enforce_eager": eager,
        "max_model_len": 512,
        "max_num_seqs": 8,
        "num_kv_blocks": 256,
    }
    prompts = [*PROMPTS, "one two three one two three one two three one two"]
    runs = []
    for extra in (
        {},
        {"enable_dp_attention": True},
        {"enable_dp_attention": True, "speculative": SpeculativeConfig("ngram", 4)},
    ):
        llm = LLM(str(deepseek), **kwargs, **extra)
        try:
            runs.append(outputs(llm, prompts, greedy(24)))
            if extra:
                assert isinstance(llm.engine.core.kv, DataParallelKV)
                assert bool(llm.engine.core.runner.graphs.graphs) is not eager
        finally:
            llm.close()
        gc.collect()
        torch.cuda.empty_cache()
    want, dp, spec = runs
    for (tok_w, lp_w), (tok_g, lp_g) in zip(want, dp, strict=True):
        assert tok_g == tok_w
        for pos_g, pos_w in zip(lp_g, lp_w, strict=True):
            assert all(abs(pos_g[t].logprob - pos_w[t].logprob) <= 1e-3 for t in pos_w)
    assert [t for t, _ in spec] == [t for t, _ in want]
