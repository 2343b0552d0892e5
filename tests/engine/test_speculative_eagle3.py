"""EAGLE-3 in the engine: a head written in the published layout loads through `LLM(...,
speculative=SpeculativeConfig("eagle3", draft_model=DIR))`, drafts every step from the target's
hidden states, and greedy output equals the output without speculation (with chunked prefill,
preemption and async scheduling); the pool is whole at the end; and the engine's drafts are the
head's own chain over the request's tokens (the wiring of positions, shifted tokens and hidden
states is right)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.models.loader import load_model
from ember.spec_decode.config import SpeculativeConfig
from tests.spec_decode.test_eagle3 import _target_forward, _weights, reference_drafts, write_head

K = 3


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def head(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("eagle3-head"), llama)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 3000, (9 + 5 * i,), generator=g).tolist() for i in range(n)]


def eagle(model: Path, head: Path, **kw) -> LLM:
    spec = SpeculativeConfig("eagle3", num_speculative_tokens=K, draft_model=str(head))
    return LLM(str(model), dtype="float32", speculative=spec, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4},
        {"block_size": 4, "num_kv_blocks": 40, "max_model_len": 64},
        {"async_scheduling": True},
    ],
    ids=["plain", "chunked", "preempting", "async"],
)
def test_eagle3_greedy_equals_no_speculation(llama: Path, head: Path, kw: dict) -> None:
    ps = prompts(5, seed=11)
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (17, 5, 30, 12, 2)
    ]
    want = [
        o.outputs[0].token_ids for o in LLM(str(llama), dtype="float32", **kw).generate(ps, params)
    ]
    llm = eagle(llama, head, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert got == want
    stats = llm.engine.core.stats()
    assert stats.spec_drafts > 0 and stats.spec_draft_tokens >= stats.spec_drafts
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


def test_engine_drafts_are_the_heads_chain(llama: Path, head: Path, monkeypatch) -> None:
    """Record the drafts the engine makes for one request; each must equal the head's greedy
    chain recomputed from scratch over the tokens the request had at that step."""
    llm = eagle(llama, head, block_size=4)
    runner = llm.engine.core.runner
    seen: list[tuple[int, list[int]]] = []
    original = runner._draft

    def record(step, result):  # type: ignore[no-untyped-def]
        drafts = original(step, result)
        for i, req in enumerate(step.so.requests):
            if drafts[i]:
                known = req.num_tokens + len(result.accepted[i]) + 1
                seen.append((known, drafts[i]))
        return drafts

    monkeypatch.setattr(runner, "_draft", record)
    prompt = prompts(1, seed=12)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    tokens = prompt + out[0].outputs[0].token_ids
    assert len(seen) >= 2

    target = load_model(llama, dtype=torch.float32)
    target.model.aux_layers = runner.drafter.aux_layers
    weights = _weights(head)
    for known, drafts in seen:
        ids = torch.tensor(tokens[:known])
        _target_forward(target, ids)
        aux = target.model.aux_hidden
        # Row p: token t_{p+1} with the target's state at p, for p < known - 1.
        want = reference_drafts(weights, target, tokens[1:known], aux[: known - 1], K)
        assert drafts == want, (known, drafts, want)


def test_past_the_batch_bound_the_head_costs_nothing(llama: Path, head: Path) -> None:
    """Above `max_batch` running requests no step speculates, and EAGLE-3's head does not grow
    its KV either (it would on every step of a busy engine): those requests are marked stale
    and draft no more; the output is the target's. Requests that run alone later do draft."""
    spec = SpeculativeConfig("eagle3", num_speculative_tokens=K, draft_model=str(head), max_batch=1)
    llm = LLM(str(llama), dtype="float32", speculative=spec)
    drafter = llm.engine.core.runner.drafter
    calls: list[int] = []
    propose = drafter.propose

    def counted(rows, k):  # type: ignore[no-untyped-def]
        calls.append(len(rows))
        return propose(rows, k)

    drafter.propose = counted
    ps = prompts(3, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [
        o.outputs[0].token_ids for o in LLM(str(llama), dtype="float32").generate(ps, [params] * 3)
    ]
    got = [o.outputs[0].token_ids for o in llm.generate(ps, [params] * 3)]
    assert got == want
    assert llm.engine.core.stats().spec_drafts == 0
    assert len(calls) <= 1  # at most the prefill's, before the batch was seen past the bound
    alone = llm.generate(ps[:1], params)[0].outputs[0].token_ids
    assert alone == want[0] and llm.engine.core.stats().spec_drafts > 0


def test_eagle3_on_two_ranks_drafts_as_one(llama: Path, head: Path) -> None:
    """A tensor-parallel target (gloo, 2 processes): the head runs on rank 0 alone, over the
    hidden states every rank holds whole, with a copy of the target's whole embedding (rank 0
    holds half its vocabulary). Greedy output equals one device's without speculation, and the
    head drafts, step by step, what it drafts beside one device's target."""
    ps = prompts(4, seed=12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (17, 9, 24, 3)
    ]
    plain = LLM(str(llama), dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate(ps, params)]
    plain.close()

    def drafting(llm: LLM) -> list[list[list[int]]]:
        runner, seen = llm.engine.core.runner, []
        original = runner._draft

        def record(step, result):  # type: ignore[no-untyped-def]
            drafts = original(step, result)
            seen.append(drafts)
            return drafts

        runner._draft = record
        assert [o.outputs[0].token_ids for o in llm.generate(ps, params)] == want
        return seen

    one = eagle(llama, head)
    one_drafts = drafting(one)
    one.close()
    two = eagle(llama, head, tensor_parallel_size=2)
    try:
        vocab = two.engine.core.model_config.vocab_size
        assert two.engine.core.runner.drafter.model.embed_tokens.weight.shape[0] == vocab
        two_drafts = drafting(two)
        assert sum(len(d) for step in two_drafts for d in step) > 0
        assert two_drafts == one_drafts
    finally:
        two.close()


def test_a_split_target_without_its_embedding_in_safetensors_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from ember.spec_decode.eagle3 import target_embedding

    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        target_embedding(tmp_path)
