"""The real proposers (n-gram, suffix) in the engine: greedy output equals the output without
speculation token for token, on a tiny model and on SmolLM2, and on SmolLM2 the drafts are
accepted where the answer repeats text (an answer that copies its prompt; a repeated request's answer
is in the suffix tree of its tenant, not of another tenant)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember import LLM, SamplingParams
from ember.spec_decode.config import SpeculativeConfig

METHODS = ("ngram", "suffix")


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("method", METHODS)
def test_tiny_model_greedy_equals_no_speculation(tiny_model_dir, method: str) -> None:
    model = str(tiny_model_dir("qwen3"))
    # Prompts that repeat themselves, so that the proposers find something to draft.
    prompts = [[11, 12, 13, 14, 15] * 6, list(range(100, 140)) * 2, [7, 8, 9] * 9 + [5]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = tokens(LLM(model, dtype="float32", block_size=4), prompts, params)
    llm = LLM(model, dtype="float32", block_size=4, speculative=SpeculativeConfig(method))
    assert tokens(llm, prompts, params) == want
    stats = llm.engine.core.stats()
    assert stats.spec_drafts > 0
    assert llm.engine.core.kv.pool.num_free_blocks == llm.engine.core.kv.pool.num_blocks


CODE = '''def total(prices, tax):
    """Sum the prices and add the tax rate."""
    subtotal = 0
    for price in prices:
        subtotal += price
    return subtotal * (1 + tax)
'''


def copy_prompt(llm: LLM) -> list[int]:
    """A completion whose answer copies text of its prompt (SmolLM2-135M does not follow an
    edit instruction reliably, but it continues a copy)."""
    text = CODE + "\n\n# The same function, copied:\n" + CODE[:30]
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


@pytest.mark.parametrize("method", METHODS)
def test_smollm2_greedy_equals_no_speculation_and_drafts_land(smollm2: Path, method: str) -> None:
    base = LLM(str(smollm2), dtype="float32", max_model_len=1024)
    prompt = copy_prompt(base)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    want = tokens(base, [prompt], params)
    llm = LLM(
        str(smollm2), dtype="float32", max_model_len=1024, speculative=SpeculativeConfig(method)
    )
    assert tokens(llm, [prompt], params) == want
    stats = llm.engine.core.stats()
    assert stats.spec_drafts > 0
    # The answer copies the function: a good share of the drafts stands (0.56 measured).
    assert stats.spec_accepted_tokens > 0.3 * stats.spec_draft_tokens


def test_smollm2_suffix_drafts_from_the_tenants_earlier_answer(smollm2: Path) -> None:
    """The same request again: the suffix tree of its tenant holds the first answer, so the
    second is drafted from it (most drafts accepted); another tenant gets no such drafts."""
    llm = LLM(
        str(smollm2),
        dtype="float32",
        max_model_len=1024,
        speculative=SpeculativeConfig("suffix", num_speculative_tokens=8),
    )
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], add_generation_prompt=True
    )
    prompt = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    runs = iter(range(100))

    def run(salt: str) -> tuple[list[int], int, int]:
        before = llm.engine.core.stats()
        rid = f"r{next(runs)}"
        llm.engine.add_request(rid, prompt, params, cache_salt=salt)
        out = llm._run([rid])[0].outputs[0].token_ids
        after = llm.engine.core.stats()
        return (
            out,
            after.spec_accepted_tokens - before.spec_accepted_tokens,
            after.spec_drafts - before.spec_drafts,
        )

    first, _, _ = run("tenant-a")
    again, accepted, drafts = run("tenant-a")
    assert again == first
    assert drafts > 0 and accepted / drafts >= 3  # mean accepted length per verification > 4
    other, accepted_b, drafts_b = run("tenant-b")
    assert other == first
    assert drafts_b == 0 or accepted_b / drafts_b < accepted / drafts


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_request_never_speculated_for_costs_its_proposer_nothing(
    tiny_model_dir, method: str
) -> None:
    """A busy engine turns speculation off: the proposer then neither indexes the request's
    prompt (that waits for the first propose) nor keeps its output for the tenant's later
    requests (the suffix method's cache); a request that does speculate gets both."""
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        speculative=SpeculativeConfig(method, num_speculative_tokens=3),
    )
    spec = llm.engine.core.spec
    assert spec is not None and spec.host is not None
    host = spec.host
    spec._enabled = lambda batch: False  # type: ignore[method-assign]  # as under load
    indexed: list[str] = []
    propose = host.propose

    def counted(request_id, tokens, max_tokens):  # type: ignore[no-untyped-def]
        indexed.append(request_id)
        return propose(request_id, tokens, max_tokens)

    host.propose = counted  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 60))}
    llm.generate([prompt], params)
    assert indexed == [] and llm.engine.core.stats().spec_drafts == 0
    if method == "suffix":
        assert host.cached_outputs(None) == 0
    # Requests added but never proposed for hold no index of their prompts.
    host.add_request("idle", list(range(3000)), None)
    state = host._requests["idle"]
    held = state.tokens if method == "ngram" else state.tree.tokens(0)
    assert held == []
    spec._enabled = lambda batch: True  # type: ignore[method-assign]
    llm.generate([prompt], params)
    assert indexed  # the prompt was indexed at the first propose
    if method == "suffix":
        assert host.cached_outputs(None) == 1
