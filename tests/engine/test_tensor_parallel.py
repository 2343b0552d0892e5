"""A tensor-parallel engine on the CPU (gloo, 2 and 4 processes): the same greedy tokens and
logprobs (float32, 1e-4) as one process, through chunked prefill, prefix-cache hits, preemption,
ngram speculation and structured output; seeded sampling equal too (rank 0 samples, the others
take its tokens); a worker killed by the test fails the engine with its error, and closing
leaves no process."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember import LLM, SamplingParams
from ember.engine.workers import WorkerFailed
from ember.sampling_params import StructuredOutputsParams
from ember.spec_decode.config import SpeculativeConfig

PROMPTS = [
    "The quick brown fox jumps over",
    "def add(a, b):\n    return",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3",
    "Hello",
]


def greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=3, ignore_eos=True)


def outputs(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple[list, list]]:
    res = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]


def assert_same(got: list[tuple[list, list]], want: list[tuple[list, list]]) -> None:
    for (tok_g, lp_g), (tok_w, lp_w) in zip(got, want, strict=True):
        assert tok_g == tok_w
        for pos_g, pos_w in zip(lp_g, lp_w, strict=True):
            assert pos_g.keys() == pos_w.keys()
            for t in pos_w:
                assert abs(pos_g[t].logprob - pos_w[t].logprob) <= 1e-4


def worker_pids(llm: LLM) -> list[int]:
    workers = llm.engine.core.workers
    return [] if workers is None else [p.pid for p in workers.procs]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone too (its parent has not reaped it yet).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ember.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-llama-tp"), "llama")


@pytest.fixture(scope="module")
def one(llama: Path) -> Iterator[LLM]:
    llm = LLM(str(llama), dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="class")
def two(llama: Path) -> Iterator[LLM]:
    llm = LLM(str(llama), dtype="float32", tensor_parallel_size=2)
    yield llm
    pids = worker_pids(llm)
    llm.close()
    assert all(gone(p) for p in pids)


class TestTwoRanks:
    """One engine of two ranks for these (one tensor-parallel engine a process at a time)."""

    def test_two_ranks_equal_one(self, one: LLM, two: LLM) -> None:
        assert len(worker_pids(two)) == 1
        assert_same(outputs(two, PROMPTS, greedy()), outputs(one, PROMPTS, greedy()))

    def test_prefix_hits_on_two_ranks(self, one: LLM, two: LLM) -> None:
        long = [PROMPTS[0] * 6 + " again"]
        want = outputs(one, long, greedy(8))
        before = two.engine.core.scheduler.prefix_hits
        assert_same(outputs(two, long, greedy(8)), want)
        assert_same(outputs(two, long, greedy(8)), want)  # its prompt's blocks now cached
        assert two.engine.core.scheduler.prefix_hits > before

    def test_seeded_sampling_on_two_ranks(self, one: LLM, two: LLM) -> None:
        p = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
        assert [t for t, _ in outputs(two, PROMPTS, p)] == [t for t, _ in outputs(one, PROMPTS, p)]

    def test_structured_output_on_two_ranks(self, one: LLM, two: LLM) -> None:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        p = SamplingParams(
            temperature=0.0,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)),
        )
        got = two.generate(PROMPTS[:2], p)
        assert [o.outputs[0].token_ids for o in got] == [
            o.outputs[0].token_ids for o in one.generate(PROMPTS[:2], p)
        ]
        for o in got:
            if o.outputs[0].finish_reason == "stop":
                assert isinstance(json.loads(o.outputs[0].text)["a"], int)


def test_chunked_prefill_and_preemption_on_two_ranks(llama: Path, one: LLM) -> None:
    want = outputs(one, PROMPTS, greedy(24))
    # Chunks of 16 tokens, and 32 blocks of 4 tokens: the four sequences (~190 tokens in all)
    # cannot all fit.
    tight = LLM(
        str(llama),
        dtype="float32",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        block_size=4,
        num_kv_blocks=32,
        max_model_len=128,
    )
    try:
        assert_same(outputs(tight, PROMPTS, greedy(24)), want)
        assert tight.engine.core.scheduler.num_preemptions > 0
        assert tight.engine.core.kv.pool.num_free_blocks == 32
    finally:
        tight.close()


def test_ngram_speculation_on_two_ranks(llama: Path, one: LLM) -> None:
    want = outputs(one, PROMPTS, greedy(24))
    spec = LLM(
        str(llama),
        dtype="float32",
        tensor_parallel_size=2,
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=4),
    )
    try:
        got = outputs(spec, PROMPTS, greedy(24))
        assert [t for t, _ in got] == [t for t, _ in want]
    finally:
        spec.close()


def test_four_ranks_equal_one(tiny_model_dir, one: LLM) -> None:  # type: ignore[no-untyped-def]
    qwen3 = tiny_model_dir("qwen3")  # tied embeddings: the LM head shares the embedding's shard
    want = LLM(str(qwen3), dtype="float32")
    four = LLM(str(qwen3), dtype="float32", tensor_parallel_size=4)
    try:
        assert len(worker_pids(four)) == 3
        assert_same(outputs(four, PROMPTS, greedy()), outputs(want, PROMPTS, greedy()))
    finally:
        pids = worker_pids(four)
        four.close()
        want.close()
    assert all(gone(p) for p in pids)


def test_a_killed_worker_fails_the_engine(llama: Path) -> None:
    llm = LLM(str(llama), dtype="float32", tensor_parallel_size=2)
    pids = worker_pids(llm)
    try:
        os.kill(pids[0], 9)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match="worker rank 1 exited with code -9"):
            for _ in range(50):  # within a few steps of its death
                llm.generate(PROMPTS, greedy(4))
        assert time.monotonic() - t0 < 10
    finally:
        llm.close()
    assert all(gone(p) for p in pids)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tensor_parallel_size": 65}, "tensor_parallel_size must be in"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be in"),
    ],
)
def test_refused_settings(llama: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(llama), dtype="float32", **{"tensor_parallel_size": 2, **kwargs})


def test_one_parallel_engine_a_process(llama: Path) -> None:
    first = LLM(str(llama), dtype="float32", tensor_parallel_size=2)
    try:
        with pytest.raises(ValueError, match="already runs a tensor-parallel engine"):
            LLM(str(llama), dtype="float32", tensor_parallel_size=2)
    finally:
        first.close()
    LLM(str(llama), dtype="float32", tensor_parallel_size=2).close()  # after it, one may start


def test_heads_the_ranks_cannot_split_are_refused(llama: Path) -> None:
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible"):
        LLM(str(llama), dtype="float32", tensor_parallel_size=3)


@pytest.mark.parametrize(
    "arch,expert_parallel",
    [("qwen3_moe", False), ("qwen3_moe", True), ("deepseek_v3", True), ("kimi_k2", False)],
)
def test_moe_models_on_two_ranks(tiny_model_dir, arch: str, expert_parallel: bool) -> None:  # type: ignore[no-untyped-def]
    """MoE split by width (TP) or by whole experts (EP); DeepSeek's MLA split by heads."""
    model = str(tiny_model_dir(arch))
    one = LLM(model, dtype="float32")
    want = outputs(one, PROMPTS, greedy(12))
    one.close()
    two = LLM(
        model, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel
    )
    try:
        assert_same(outputs(two, PROMPTS, greedy(12)), want)
    finally:
        two.close()


def test_quantized_model_on_two_ranks(tmp_path: Path) -> None:
    """Kimi K2.5's scheme (INT4 routed experts, compressed-tensors) at two ranks, experts split
    whole across them, equals one rank."""
    from tests.models.quant_checkpoints import make_quantized

    _, quantized, _ = make_quantized(tmp_path, "kimi_k2_int4")
    one = LLM(str(quantized), dtype="float32")
    want = outputs(one, PROMPTS, greedy(12))
    one.close()
    two = LLM(str(quantized), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert_same(outputs(two, PROMPTS, greedy(12)), want)
    finally:
        two.close()


def test_expert_load_per_rank(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Under expert parallel each rank counts the (token, expert) pairs its experts took; over
    the ranks they are every token's top_k in every MoE layer."""
    from ember.models.config import ModelConfig

    model = tiny_model_dir("qwen3_moe")
    cfg = ModelConfig.from_dir(model)
    llm = LLM(str(model), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        res = llm.generate(PROMPTS, greedy(12))
        # Every prompt token and every output token but the last went through the model.
        tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in res)
        want = tokens * cfg.num_experts_per_tok * cfg.num_hidden_layers
        deadline = time.monotonic() + 10
        while True:
            load = llm.engine.core.stats().expert_load
            if (len(load) == 2 and sum(load) == want) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(load) == 2 and sum(load) == want and min(load) > 0, (load, want)
    finally:
        llm.close()


def test_async_scheduling_on_two_ranks(llama: Path, one: LLM) -> None:
    """Each step launched before the last one's tokens reach the host: the workers feed them
    from the tokens rank 0 broadcast (as a GPU engine does)."""
    want = outputs(one, PROMPTS, greedy(16))
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    want_seeded = [t for t, _ in outputs(one, PROMPTS, seeded)]
    two = LLM(str(llama), dtype="float32", tensor_parallel_size=2, async_scheduling=True)
    try:
        assert two.engine.core.async_scheduling
        assert_same(outputs(two, PROMPTS, greedy(16)), want)
        assert [t for t, _ in outputs(two, PROMPTS, seeded)] == want_seeded
    finally:
        two.close()
