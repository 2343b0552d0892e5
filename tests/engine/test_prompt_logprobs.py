"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) against transformers' log-softmax on a
tiny Llama in float32: whole and chunked prefills, async scheduling, a prefix already in the cache,
mixed batches, n samples, preemption, and the slicing that bounds the float32 logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember import LLM, SamplingParams
from ember.engine import sampler
from ember.engine.request import Request
from ember.engine.sampler import score_tokens
from ember.engine.scheduler import Scheduler
from ember.outputs import Logprob

ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf(llama: Path):
    return AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()


def random_prompt(seed: int, length: int, vocab: int = 3000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (length,), generator=g).tolist()


@torch.no_grad()
def reference(hf, prompt: list[int]) -> torch.Tensor:
    """Row p: the log-softmax that scores prompt token p + 1."""
    return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def check(scored: list[dict[int, Logprob] | None] | None, prompt: list[int], ref, k: int) -> None:
    assert scored is not None and len(scored) == len(prompt)
    assert scored[0] is None
    for p in range(1, len(prompt)):
        step, row, tok = scored[p], ref[p - 1], prompt[p]
        assert step is not None
        want = row[tok].item()
        assert abs(step[tok].logprob - want) <= ATOL, f"position {p}"
        # The rank counts the tokens at least as likely (ties within ATOL either way).
        rank = step[tok].rank
        assert rank is not None
        assert int((row > want + ATOL).sum()) + 1 <= rank <= int((row >= want - ATOL).sum())
        alternatives = sorted((lp.rank, t, lp.logprob) for t, lp in step.items() if lp.rank <= k)
        assert [r for r, _, _ in alternatives] == list(range(1, k + 1))
        top = row.topk(k).values.tolist() if k else []
        for (_, t, lp), best in zip(alternatives, top, strict=True):
            assert abs(lp - best) <= ATOL and abs(lp - row[t].item()) <= ATOL
        assert set(step) <= {tok, *(t for _, t, _ in alternatives)}


def scoring(k: int, max_tokens: int = 1, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k, **kw
    )


@pytest.mark.parametrize(
    "chunk,async_scheduling",
    [(None, False), (7, False), (7, True)],
    ids=["whole", "chunked", "chunked-async"],
)
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_transformers(
    llama: Path, hf, chunk: int | None, async_scheduling: bool, k: int
) -> None:
    llm = LLM(
        str(llama),
        dtype="float32",
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=chunk,
        async_scheduling=async_scheduling,
    )
    prompt = random_prompt(1, 45)
    out = llm.generate(prompt, scoring(k, max_tokens=4))[0]
    check(out.prompt_logprobs, prompt, reference(hf, prompt), k)
    assert len(out.outputs[0].token_ids) == 4


def test_a_cached_prefix_is_computed_again_for_scoring(llama: Path, hf) -> None:
    llm = LLM(str(llama), dtype="float32", block_size=4, max_model_len=256)
    prompt = random_prompt(2, 41)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prompt[:33], plain)  # caches eight blocks of the prompt
    out = llm.generate(prompt, scoring(2))[0]
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, prompt, reference(hf, prompt), 2)
    # Scoring left the cache as it was: a plain request still hits it.
    again = llm.generate(prompt, plain)[0]
    assert again.num_cached_tokens == 40 and again.prompt_logprobs is None


def test_a_mixed_chunked_batch(llama: Path, hf) -> None:
    """Rows of requests that score sit between rows of requests that do not, chunk by chunk."""
    llm = LLM(
        str(llama), dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=9
    )
    prompts = [random_prompt(10 + i, n) for i, n in enumerate([23, 1, 17, 30, 2])]
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    params = [scoring(1), scoring(0), plain, scoring(4), scoring(2)]
    outs = llm.generate(prompts, params)
    assert outs[2].prompt_logprobs is None
    assert outs[1].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    for i in (0, 3, 4):
        k = params[i].prompt_logprobs
        assert k is not None
        check(outs[i].prompt_logprobs, prompts[i], reference(hf, prompts[i]), k)
    # Every asking request finished: later steps look for no prompt rows.
    assert llm.engine.core.scheduler.num_prompt_scorers == 0


def test_n_samples_share_one_prompt_score(llama: Path, hf) -> None:
    llm = LLM(str(llama), dtype="float32", block_size=4, max_model_len=256)
    prompt = random_prompt(3, 20)
    out = llm.generate(prompt, SamplingParams(n=3, max_tokens=5, seed=1, prompt_logprobs=1))[0]
    assert len(out.outputs) == 3
    check(out.prompt_logprobs, prompt, reference(hf, prompt), 1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_scores_survive_preemption_mid_prefill(
    llama: Path, hf, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """A KV cache too small for every request at once preempts some in the middle of their
    chunked prefill; the recomputed prompt is not scored twice and the scores stay exact."""
    mid_prefill = []
    preempt = Scheduler._preempt

    def spy(self: Scheduler, req: Request) -> None:
        mid_prefill.append(req.scores_prompt)
        preempt(self, req)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    llm = LLM(
        str(llama),
        dtype="float32",
        block_size=4,
        max_model_len=64,
        num_kv_blocks=16,
        max_num_batched_tokens=8,
        async_scheduling=async_scheduling,
    )
    prompts = [random_prompt(20 + i, 30 + i) for i in range(4)]
    outs = llm.generate(prompts, scoring(2, max_tokens=10))
    assert any(mid_prefill)
    for prompt, out in zip(prompts, outs, strict=True):
        check(out.prompt_logprobs, prompt, reference(hf, prompt), 2)
        assert len(out.outputs[0].token_ids) == 10


def test_temperature_and_penalties_do_not_touch_prompt_scores(llama: Path, hf) -> None:
    llm = LLM(str(llama), dtype="float32", block_size=4, max_model_len=256)
    prompt = random_prompt(4, 25)
    params = SamplingParams(
        temperature=1.7, top_k=5, repetition_penalty=1.5, presence_penalty=1.0, prompt_logprobs=1
    )
    check(llm.generate(prompt, params)[0].prompt_logprobs, prompt, reference(hf, prompt), 1)


def test_prompt_logprobs_are_range_checked(llama: Path) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative"):
        SamplingParams(prompt_logprobs=-1)
    llm = LLM(str(llama), dtype="float32", max_model_len=64)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="prompt_logprobs must be at most vocab_size"):
        llm.generate([5, 6, 7], SamplingParams(prompt_logprobs=vocab + 1))
    assert not llm.engine.has_unfinished_requests()


def test_score_tokens_in_slices_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g)
    hidden = torch.randn(37, 8, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)

    def logits(h: torch.Tensor) -> torch.Tensor:
        return h @ weight.T

    whole = score_tokens(hidden, targets, 4, logits, 50)
    monkeypatch.setattr(sampler, "MAX_SCORED_LOGITS", 50 * 5)  # five rows a slice
    sliced = score_tokens(hidden, targets, 4, logits, 50)
    # Matmuls of other shapes may round differently: the same values within float32 noise.
    assert torch.allclose(whole[0], sliced[0], atol=1e-6)
    assert torch.equal(whole[1], sliced[1]) and torch.equal(whole[2], sliced[2])
    ref = logits(hidden).log_softmax(-1)
    assert torch.allclose(whole[0][:, 0], ref.gather(1, targets[:, None])[:, 0])
    assert torch.equal(whole[1][:, 0], targets)
    assert torch.equal(whole[1][:, 1:], ref.topk(4).indices)
    ranks = (ref >= ref.gather(1, targets[:, None])).sum(-1)
    assert torch.equal(whole[2], ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prompt_logprobs_on_gpu(llama: Path) -> None:
    """The CUDA path: async scheduling, pinned copies, decode steps in CUDA graphs beside the
    scoring steps (which run eagerly), chunked prefills."""
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).cuda().eval()
    llm = LLM(
        str(llama),
        device="cuda",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=16,
        num_kv_blocks=512,
        max_num_batched_tokens=64,
    )
    prompts = [random_prompt(30 + i, n) for i, n in enumerate([150, 40, 90])]
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, [scoring(3, max_tokens=20), plain, scoring(0, max_tokens=5)])
    assert outs[1].prompt_logprobs is None
    for i, k in ((0, 3), (2, 0)):
        with torch.no_grad():
            x = torch.tensor([prompts[i]], device="cuda")
            ref = hf(x).logits[0, :-1].float().log_softmax(-1).cpu()
        scored = outs[i].prompt_logprobs
        assert scored is not None and len(scored) == len(prompts[i])
        for p in range(1, len(prompts[i])):
            step, tok = scored[p], prompts[i][p]
            assert step is not None and abs(step[tok].logprob - ref[p - 1, tok].item()) < 1e-3
            assert len(step) >= k
