"""Speculative decoding in the engine: greedy output is token-for-token the output without
speculation whatever the drafts (right, wrong, cut by max_tokens, stop ids, stop strings, a
grammar), with chunked prefill, preemption and async scheduling; logprobs are the target's; the
pool is whole at the end; and sampled output keeps the target's distribution (chi-square).

The drafts come from an oracle proposer that knows the reference run's output and corrupts some
of it on purpose, so every acceptance length, rejection position and bonus token is exercised
(random tiny models give n-gram lookups little to find; the proposers have their own tests)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.speculation import StepCosts
from ember.sampling_params import StructuredOutputsParams
from ember.spec_decode.config import SpeculativeConfig
from ember.spec_decode.proposer import HostProposer
from tests.engine.test_async_scheduling import assert_same, prompts, run


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


class Oracle(HostProposer):
    """Drafts the reference continuation of the request's prompt; every `corrupt`-th proposal has
    one token changed (at a position that moves from call to call)."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], corrupt: int = 0) -> None:
        self.reference = reference
        self.corrupt = corrupt
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.calls = 0
        self.finished: list[str] = []

    def add_request(self, request_id: str, prompt: Sequence[int], scope: str | None) -> None:
        self.prompts[request_id] = tuple(prompt)

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        prompt = self.prompts[request_id]
        ref = self.reference.get(prompt, [])
        done = len(tokens) - len(prompt)
        drafts = list(ref[done : done + max_tokens])
        self.calls += 1
        if drafts and self.corrupt and self.calls % self.corrupt == 0:
            j = self.calls % len(drafts)
            drafts[j] = (drafts[j] + 1) % 3000
        return drafts

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        self.finished.append(request_id)
        del self.prompts[request_id]


def greedy_params(stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id], min_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    ]


def speculating(model: Path, oracle: Oracle, k: int = 4, **kw) -> LLM:
    llm = LLM(
        str(model),
        dtype="float32",
        speculative=SpeculativeConfig("ngram", num_speculative_tokens=k),
        **kw,
    )
    spec = llm.engine.core.spec
    assert spec is not None
    spec.host = oracle
    return llm


def assert_pool_whole(llm: LLM) -> None:
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4},  # chunked prefills beside verifications
        {"block_size": 4, "num_kv_blocks": 40, "max_model_len": 64},  # preemption
        {"async_scheduling": True},
    ],
    ids=["plain", "chunked", "preempting", "async"],
)
@pytest.mark.parametrize("corrupt", [0, 3], ids=["right-drafts", "some-wrong"])
def test_greedy_equals_no_speculation(llama: Path, kw: dict, corrupt: int) -> None:
    ps = prompts(6, seed=1)
    base = LLM(str(llama), dtype="float32", **kw)
    probe = base.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    params = greedy_params(stop_id=probe[0].outputs[0].token_ids[5])
    want = run(base, ps, params)
    reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
    llm = speculating(llama, Oracle(reference, corrupt), **kw)
    got = run(llm, ps, params)
    assert_same(got, want)
    stats = llm.engine.core.stats()
    assert stats.spec_drafts > 0
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    if corrupt:
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    else:  # right drafts are all accepted
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1]
    assert sum(stats.spec_accepted_per_pos) == stats.spec_accepted_tokens
    assert_pool_whole(llm)
    assert sorted(llm.engine.core.spec.host.finished) == sorted(  # every request told once
        set(llm.engine.core.spec.host.finished)
    )


def test_speculation_turned_on_and_off_between_async_steps(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's cost model turns speculation off for a probe step now and then: a request
    whose verification is still in flight must be collected before it is scheduled again (it
    once was not, and a step was scheduled with a negative token count on the GPU)."""
    monkeypatch.setattr(StepCosts, "PROBE_EVERY", 4)
    monkeypatch.setattr(StepCosts, "WINDOW", 2)
    ps = prompts(4, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = LLM(str(llama), dtype="float32", async_scheduling=True)
    want = run(base, ps, [params] * 4)
    reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
    llm = speculating(llama, Oracle(reference, corrupt=3), async_scheduling=True)
    spec = llm.engine.core.spec
    spec.costs = StepCosts()  # as on a GPU
    assert_same(run(llm, ps, [params] * 4), want)
    stats = llm.engine.core.stats()
    assert stats.spec_drafts > 0
    rates = list(spec.costs.rate.values())
    assert any(False in r for r in rates) and any(True in r for r in rates)  # both modes ran
    assert_pool_whole(llm)


def _simulated_costs(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, plain_s: float, verify_s: float
) -> list[bool]:
    """The engine's cost model as on a GPU, on a clock that advances by a plain or a verify
    step's time at each collected step; returns whether each collected step speculated."""
    from ember.engine import speculation

    clock = [100.0]
    monkeypatch.setattr(speculation.time, "perf_counter", lambda: clock[0])
    spec = llm.engine.core.spec
    spec.costs = StepCosts()
    modes: list[bool] = []
    record = spec.record_step

    def timed(so, accepted, launched_at):  # type: ignore[no-untyped-def]
        clock[0] += verify_s if any(so.spec_token_ids or []) else plain_s
        modes.append(so.speculating)
        return record(so, accepted, launched_at)

    monkeypatch.setattr(spec, "record_step", timed)
    return modes


@pytest.mark.parametrize("batch", [16, 1])
def test_the_cost_model_speculates_where_it_pays(
    llama: Path, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """Batch 16 with drafts that are always wrong and verify steps 2.5x a plain one: the engine
    decodes plainly but for its learning steps and probe windows. Batch 1 with right drafts and verify
    steps 1.25x: it speculates but for those windows."""
    ps = prompts(batch, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    base = LLM(str(llama), dtype="float32", async_scheduling=True)
    want = run(base, ps, [params] * batch)
    reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
    if batch > 1:
        drafts = {p: [(t + 7) % 3000 for t in ref] for p, ref in reference.items()}
        llm = speculating(llama, Oracle(drafts), async_scheduling=True, max_num_seqs=batch)
        modes = _simulated_costs(llm, monkeypatch, plain_s=0.002, verify_s=0.005)
    else:
        llm = speculating(llama, Oracle(reference), async_scheduling=True)
        modes = _simulated_costs(llm, monkeypatch, plain_s=0.0012, verify_s=0.0015)
    assert_same(run(llm, ps, [params] * batch), want)
    decode = modes[-100:]  # the decode steps (the first are prefills)
    w = StepCosts.WINDOW
    if batch > 1:  # learning (MIN_SPEC counted steps) and a probe window
        assert decode.count(True) <= StepCosts.MIN_SPEC + w + 1, decode
    else:
        assert decode.count(False) <= 2 * w + 1, decode
    assert_pool_whole(llm)


def test_step_costs_decide_by_measured_rates() -> None:
    costs = StepCosts()
    w, probe, need = StepCosts.WINDOW, StepCosts.PROBE_EVERY, StepCosts.MIN_SPEC
    # A size's first window decodes plainly; then it speculates until MIN_SPEC steps are counted.
    assert [costs.worth_it(64) for _ in range(w)] == [False] * w
    # H200, SmolLM2, batch 64: 41 tokens in 2.8 ms plainly, 61 in 6.6 ms speculating.
    for _ in range(w):
        costs.observe(64, False, 0.0028, 41)
    assert costs.rate[64][False] == pytest.approx(41 / 0.0028)  # first of a window: not counted
    for _ in range(need):  # the first is a transition, not counted: one more to go
        assert costs.worth_it(64)
        costs.observe(64, True, 0.0066, 61)
    assert costs.worth_it(64)
    costs.observe(64, True, 0.0066, 61)
    assert costs.rate[64][True] == pytest.approx(61 / 0.0066)
    decisions = [costs.worth_it(64) for _ in range(2 * probe)]
    assert decisions.count(True) == 2 * w  # plain, but for a window of speculation every PROBE
    assert all(
        decisions[i] for i in range(len(decisions)) if (i + w + need + 1) % probe >= probe - w
    )
    # Where speculation makes more tokens a second it holds (batch 1: 1 token in 1.2 ms, 3 in 1.5).
    for _ in range(w + need + 1):
        costs.worth_it(1)
    for verified, seconds, tokens in [(False, 0.0012, 1)] * w + [(True, 0.0015, 3)] * (need + 1):
        costs.observe(1, verified, seconds, tokens)
    assert costs.worth_it(1) and costs.bucket(33) == costs.bucket(64) == 64


def test_step_costs_want_many_samples_and_skip_outliers() -> None:
    """Drafts that miss at the start of an answer (its first steps) do not turn speculation off
    for the answer: MIN_SPEC counted steps come first, and a rate is over the last SAMPLES steps
    of its mode, not a few. A drained async step (~0 s) or a host hiccup is no sample; two such
    periods in a row are (the mode's cost has changed)."""
    costs = StepCosts()
    w = StepCosts.WINDOW
    for _ in range(w):
        costs.worth_it(1)
        costs.observe(1, False, 0.0012, 1)
    costs.observe(1, False, 0.00001, 1)  # an async pipeline drains: no sample
    assert costs.rate[1][False] == pytest.approx(1 / 0.0012)
    # The answer's start: four verifications with nothing accepted, then drafts that stand.
    steps = [(0.0016, 1)] * 5 + [(0.0016, 5)] * (StepCosts.MIN_SPEC - 4)
    for seconds, tokens in steps:
        assert costs.worth_it(1)
        costs.observe(1, True, seconds, tokens)
    assert costs.worth_it(1)  # 4 steps at 1 token then 8 at 5: 3.7 tokens / 1.6 ms
    costs.observe(1, True, 0.050, 5)  # a hiccup: no sample
    assert costs.rate[1][True] == pytest.approx((4 + 8 * 5) / (12 * 0.0016))
    costs.observe(1, True, 0.050, 5)  # the second in a row: a sample
    assert costs.totals((1, True))[1] == pytest.approx(12 * 0.0016 + 0.050)
    for _ in range(StepCosts.SAMPLES):
        costs.observe(1, True, 0.0016, 1)
    assert costs.rate[1][True] == pytest.approx(1 / 0.0016)  # only the last SAMPLES count
    assert not costs.worth_it(1)  # plain decoding is faster now (and this is no probe step)


def test_a_gpu_engine_speculates_only_up_to_the_default_batch_bound() -> None:
    """Past DEFAULT_MAX_BATCH running requests a GPU engine never speculates (no cost-model
    probe either); an explicit max_batch alone decides; the CPU always speculates."""
    from ember.engine.speculation import Speculator
    from ember.spec_decode.config import DEFAULT_MAX_BATCH

    gpu = Speculator(SpeculativeConfig("ngram", 4), measure=True)
    assert gpu.costs is not None
    assert not gpu._enabled(DEFAULT_MAX_BATCH + 1)
    assert gpu.costs._steps == {}  # the cost model was not asked
    gpu._enabled(DEFAULT_MAX_BATCH)
    assert gpu.costs._steps == {StepCosts.bucket(DEFAULT_MAX_BATCH): 1}
    bound = Speculator(SpeculativeConfig("ngram", 4, max_batch=64), measure=True)
    assert bound.costs is None and bound._enabled(64) and not bound._enabled(65)
    cpu = Speculator(SpeculativeConfig("ngram", 4), measure=False)
    assert cpu._enabled(1000)


def test_verify_graphs_stop_where_speculation_does() -> None:
    """No graph for a verify batch the engine can never run: at most (k + 1) rows for each of
    DEFAULT_MAX_BATCH requests (or max_batch's), and no more requests than the graphs' batch."""
    from ember.engine.cuda_graphs import verify_graph_sizes
    from ember.engine.speculation import verify_graph_rows
    from ember.spec_decode.config import DEFAULT_MAX_BATCH

    assert verify_graph_rows(SpeculativeConfig("ngram"), 256) == DEFAULT_MAX_BATCH * 9
    assert verify_graph_sizes(256, verify_graph_rows(SpeculativeConfig("ngram"), 256))[-1] == 144
    assert verify_graph_rows(SpeculativeConfig("ngram", 4, max_batch=64), 256) == 64 * 5
    assert verify_graph_rows(SpeculativeConfig("suffix", 4, max_batch=64), 8) == 8 * 5
    assert verify_graph_rows(SpeculativeConfig("ngram", 4, max_batch=0), 256) == 0


def test_a_step_transition_is_not_counted() -> None:
    """A mode's first step after the other (a plain step with no async overlap yet) is no
    sample of its rate."""
    costs = StepCosts()
    costs.observe(8, False, 0.001, 8)  # the size's first step: a transition from nothing
    assert 8 not in costs.rate
    costs.observe(8, False, 0.001, 8)
    costs.observe(8, True, 0.010, 8)  # slow: the pipeline drains
    costs.observe(8, True, 0.002, 24)
    costs.observe(8, False, 0.005, 8)
    assert costs.rate[8] == {False: pytest.approx(8000.0), True: pytest.approx(12000.0)}


def test_a_steps_period_runs_from_the_last_steps_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A speculating step is collected before the next is planned, so the host's planning,
    proposing and scheduling before its launch are part of its period (they were once left out,
    which made verification look cheaper than it was); time with no step running is not."""
    import types

    from ember.engine import speculation

    clock = [0.0]
    monkeypatch.setattr(speculation.time, "perf_counter", lambda: clock[0])
    spec = speculation.Speculator(SpeculativeConfig("ngram", 2), measure=True)
    assert spec.costs is not None
    seen: list[tuple[int, bool, float, int]] = []
    monkeypatch.setattr(spec.costs, "observe", lambda *a: seen.append(a))
    req = types.SimpleNamespace(spec_draft_tokens=0, spec_accepted_tokens=0)

    def step(drafts: list[int]) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            requests=[req],
            spec_token_ids=[drafts],
            num_scheduled_tokens=[1 + len(drafts)],
            speculating=bool(drafts),
        )

    busy = [types.SimpleNamespace(speculates=False, sampling_params=SamplingParams())]
    clock[0] = 5.0  # idle until now: not counted
    spec.plan([])
    clock[0] = 5.001  # the first step is launched
    launched = clock[0]
    clock[0] = 5.003  # collected 2 ms later
    spec.record_step(step([]), [[]], launched)
    clock[0] = 5.0035  # outputs handed out; the next engine step plans, proposes, launches
    spec.plan(busy)
    clock[0] = 5.0045
    launched = clock[0]
    clock[0] = 5.0075  # collected
    spec.record_step(step([7, 8]), [[7]], launched)
    clock[0] = 5.0095  # a speculating step whose proposals all came back empty
    empty = step([])
    empty.speculating = True
    spec.record_step(empty, [[]], clock[0])
    assert seen == [
        (1, False, pytest.approx(0.002), 1, True),
        (1, True, pytest.approx(0.0045), 2, True),  # from the previous step's end
        (1, True, pytest.approx(0.002), 1, False),  # verified nothing: no sample
    ]
    assert spec.num_accepted_tokens == 1 and req.spec_accepted_tokens == 1


class Silent(Oracle):
    """The oracle's drafts, but none for a request's first `quiet` output tokens."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], quiet: int) -> None:
        super().__init__(reference)
        self.quiet = quiet

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        if len(tokens) - len(self.prompts[request_id]) < self.quiet:
            self.calls += 1
            return []
        return super().propose(request_id, tokens, max_tokens)


@pytest.mark.parametrize("quiet", [1000, 40])
def test_a_request_whose_proposals_miss_sits_out_and_comes_back(llama: Path, quiet: int) -> None:
    """While its proposals give nothing, a request sits out 1, 2, 4 .. 16 steps between tries
    (those steps run async: no wait for tokens); a draft that stands brings it back at once.
    Output is the same either way."""
    ps = prompts(2, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    base = LLM(str(llama), dtype="float32", async_scheduling=True)
    want = run(base, ps, [params] * 2)
    reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
    oracle = Silent(reference, quiet)
    llm = speculating(llama, oracle, async_scheduling=True)
    assert_same(run(llm, ps, [params] * 2), want)
    stats = llm.engine.core.stats()
    if quiet > 100:  # never a draft: tries at outputs 1, 2, 4, 7, 12, 21, 38, 55, 72, 89
        assert stats.spec_drafts == 0 and oracle.calls <= 2 * 11
    else:  # silent for 40 tokens, then right: back within 16 steps, then 4 drafts + 1 a step
        assert stats.spec_drafts > 0 and stats.spec_accepted_tokens == 4 * stats.spec_drafts
        assert stats.spec_drafts >= 2 * ((100 - quiet - 16) // 5 - 1)
    assert_pool_whole(llm)


def test_wrong_drafts_change_nothing_and_leak_nothing(llama: Path) -> None:
    """Drafts that are always wrong: every one rejected, output the same, every block back."""
    ps = prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    base = LLM(str(llama), dtype="float32", block_size=4)
    want = run(base, ps, [params] * 4)
    wrong = {tuple(p): [(t + 7) % 3000 for t in w[0]] for p, w in zip(ps, want, strict=True)}
    llm = speculating(llama, Oracle(wrong), block_size=4)
    assert_same(run(llm, ps, [params] * 4), want)
    stats = llm.engine.core.stats()
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens == 0
    assert_pool_whole(llm)


def test_stop_string_inside_an_accepted_run(llama: Path) -> None:
    """A stop string that ends inside the drafts of one step cuts the text where it would have
    without speculation."""
    ps = prompts(1, seed=3)
    base = LLM(str(llama), dtype="float32")
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = base.generate(ps, plain)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "the tiny model's text has a usable middle"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = base.generate(ps, params)[0].outputs[0]
    llm = speculating(llama, Oracle({tuple(ps[0]): full.token_ids}), k=6)
    got = llm.generate(ps, params)[0].outputs[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (
        want.text,
        want.finish_reason,
        want.stop_reason,
    )
    assert got.finish_reason == "stop" and len(got.text) < len(full.text)
    assert_pool_whole(llm)


def test_grammar_applies_inside_drafts(llama: Path) -> None:
    """A regex grammar: drafts the grammar refuses are rejected; the output is the one without
    speculation and matches the grammar."""
    ps = prompts(2, seed=4)
    so = StructuredOutputsParams(regex=r"[a-z]{3,12}")
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so)
    base = LLM(str(llama), dtype="float32")
    want = run(base, ps, [params] * 2)
    for corrupt in (0, 2):
        reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
        llm = speculating(llama, Oracle(reference, corrupt))
        got = run(llm, ps, [params] * 2)
        assert_same(got, want)
        assert llm.engine.core.stats().spec_drafts > 0
        assert_pool_whole(llm)


def test_request_may_turn_speculation_off(llama: Path) -> None:
    ps = prompts(2, seed=5)
    base = LLM(str(llama), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = run(base, ps, [params] * 2)
    reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
    llm = speculating(llama, Oracle(reference))
    off = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, speculative=False)
    assert_same(run(llm, ps, [off] * 2), want)
    assert llm.engine.core.stats().spec_drafts == 0


def test_seeded_sampling_is_reproducible_with_speculation(llama: Path) -> None:
    ps = prompts(3, seed=6)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=42, ignore_eos=True)
    base = LLM(str(llama), dtype="float32")
    greedy = run(base, ps, [SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)] * 3)
    reference = {tuple(p): w[0] for p, w in zip(ps, greedy, strict=True)}
    first = run(speculating(llama, Oracle(reference)), ps, [params] * 3)
    second = run(speculating(llama, Oracle(reference)), ps, [params] * 3)
    assert [f[0] for f in first] == [s[0] for s in second]


# -- the distribution --------------------------------------------------------------------------

VOCAB = 12


@pytest.fixture(scope="module")
def small_vocab(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama cut to a 12-token vocabulary with a sharper head: few enough outcomes for
    a chi-square test over the first two tokens."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("small-vocab")
    for f in llama.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((llama / "config.json").read_text())
    config["vocab_size"] = VOCAB
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config))
    for f in llama.glob("*.safetensors"):
        w = load_file(f)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in w:
                w[name] = w[name][:VOCAB].clone() * (2.5 if name == "lm_head.weight" else 1.0)
        save_file(w, out / f.name)
    return out


def _top_p(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The target's distribution after temperature 1 and top-p, as the sampler defines it."""
    probs = logprobs.exp()
    sorted_p, idx = probs.sort()
    outside = sorted_p.cumsum(0) <= 1.0 - top_p
    outside[-1] = False
    sorted_p[outside] = 0.0
    kept = torch.zeros_like(probs).scatter(0, idx, sorted_p)
    return kept / kept.sum()


def _next_dist(llm: LLM, tokens: list[int], top_p: float) -> torch.Tensor:
    """The model's distribution after `tokens`, from its prompt logprobs (no speculation)."""
    out = llm.generate(
        [tokens + [0]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=VOCAB)
    )[0]
    last = out.prompt_logprobs[-1]
    logprobs = torch.full((VOCAB,), -math.inf, dtype=torch.float64)
    for t, lp in last.items():
        logprobs[t] = lp.logprob
    return _top_p(logprobs, top_p)


class TableOracle(Oracle):
    """Drafts looked up by the output so far."""

    def __init__(self, table: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__({})
        self.table = table

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        output = tuple(tokens[len(self.prompts[request_id]) :])
        return self.table.get(output, [])[:max_tokens]


def test_sampled_distribution_is_the_targets(small_vocab: Path) -> None:
    """M = 3: the joint distribution of the first three tokens (the first comes from the
    prefill, the other two from verification of two drafts: the most likely tokens, accepted
    often and rejected often), 3,000 samples with temperature 1 and top-p 0.9. Cells with an
    expected count < 5 are pooled. The test fails when a correct sampler's statistic exceeds the
    chi-square quantile at 1 - 1e-3: a failure probability of 0.1% (fixed seeds make the outcome
    the same on every run). The same counts tested against the distribution of a verifier that
    always accepted the drafts must be rejected (the test has power)."""
    prompt = [3, 7, 1, 4]
    top_p, n = 0.9, 3000
    base = LLM(str(small_vocab), dtype="float32", seed=1)
    dist = {(): _next_dist(base, prompt, top_p)}
    for a in torch.nonzero(dist[()]).flatten().tolist():
        dist[(a,)] = _next_dist(base, prompt + [a], top_p)
        for b in torch.nonzero(dist[(a,)]).flatten().tolist():
            dist[(a, b)] = _next_dist(base, prompt + [a, b], top_p)
    expected: dict[tuple[int, ...], float] = {}
    table: dict[tuple[int, ...], list[int]] = {}
    for (a, b), p3 in ((k, v) for k, v in dist.items() if len(k) == 2):
        for c in range(VOCAB):
            expected[(a, b, c)] = float(dist[()][a] * dist[(a,)][b] * p3[c])
    for (a,), p2 in ((k, v) for k, v in dist.items() if len(k) == 1):
        d2 = int(p2.argmax())
        table[(a,)] = [d2, int(dist[(a, d2)].argmax())]

    llm = speculating(small_vocab, TableOracle(table), k=2, seed=1)
    # A fourth token makes room for both drafts (the last is never a draft); it is not counted.
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt] * n, params)
    counts = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    stats = llm.engine.core.stats()
    assert stats.spec_drafts >= n
    first, second = stats.spec_accepted_per_pos
    assert 0.2 * n < first < 0.95 * n and 0.1 * n < second < first  # accepted and rejected often
    assert sum(counts.values()) == n and all(k in expected for k in counts)

    def chi2(probs: dict[tuple[int, ...], float]) -> tuple[float, int]:
        big = [c for c in probs if probs[c] * n >= 5]
        small = [c for c in probs if probs[c] * n < 5]
        obs = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
        exp = [probs[c] * n for c in big] + [sum(probs[c] for c in small) * n]
        stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
        return stat, sum(1 for e in exp if e > 0) - 1

    stat, dof = chi2(expected)
    assert dof >= 3
    assert stat < _chi2_quantile(dof, 1e-3), (stat, dof)
    # A verifier that accepted every draft would give (a, d2, d3) whenever it drafts.
    always = {c: 0.0 for c in expected}
    for (a,), (d2, d3) in table.items():
        always[(a, d2, d3)] += float(dist[()][a])
    assert chi2(always)[0] > _chi2_quantile(dof, 1e-3)


def _chi2_quantile(dof: int, alpha: float) -> float:
    """Upper-alpha quantile of chi-square(dof) by the Wilson-Hilferty approximation (within ~1%
    for dof >= 3; scipy is not a dependency)."""
    z = {1e-3: 3.090232, 1e-2: 2.326348}[alpha]
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_greedy_equals_no_speculation_on_the_gpu(llama: Path, eager: bool) -> None:
    """On the GPU (float32): verifications replay the decode CUDA graphs (k + 1 decode rows per
    request) or run eagerly through the prefill kernel; both give the output without
    speculation, with async scheduling on, and leak no block."""
    kw = dict(device="cuda", enforce_eager=eager, num_kv_blocks=512, kv_host_gb=0)
    ps = prompts(6, seed=1)
    base = LLM(str(llama), dtype="float32", **kw)
    probe = base.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    params = greedy_params(stop_id=probe[0].outputs[0].token_ids[5])
    want = run(base, ps, params)
    reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
    llm = speculating(llama, Oracle(reference, corrupt=3), **kw)
    llm.engine.core.spec.costs = None  # the GPU's cost model would skip probe steps
    assert_same(run(llm, ps, params), want)
    stats = llm.engine.core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert_pool_whole(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plain_steps_of_a_speculating_engine_are_a_plain_engines(llama: Path) -> None:
    """In bfloat16 on the GPU, a speculating engine above its batch bound (it never drafts) gives
    the tokens and logprobs of an engine without speculation, greedy and sampled: its decode
    steps replay the same graphs."""
    kw = dict(device="cuda", dtype="bfloat16", num_kv_blocks=512, kv_host_gb=0)
    ps = prompts(6, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    params = [
        greedy
        if i % 2
        else SamplingParams(temperature=0.9, top_p=0.9, max_tokens=40, ignore_eos=True, seed=i)
        for i in range(6)
    ]
    want = run(LLM(str(llama), **kw), ps, params)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, max_batch=2)
    llm = LLM(str(llama), speculative=spec, **kw)
    got = run(llm, ps, params)
    assert llm.engine.core.stats().spec_drafts == 0
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert [g[3] for g in got] == [w[3] for w in want]


def test_verify_batches_get_graphs_past_the_decode_sizes() -> None:
    """A verify batch is k + 1 rows a request: a few graphs every 64 rows past the decode sizes
    (on an H200, 64 requests x 5 rows ran eagerly at 18-46 ms a step against 2.8 ms)."""
    from ember.engine.cuda_graphs import cuda_graph_sizes, graph_sizes

    assert graph_sizes(64) == cuda_graph_sizes(64)
    assert graph_sizes(64, 320) == cuda_graph_sizes(64) + [128, 192, 256, 320]
    assert graph_sizes(256, 1280) == cuda_graph_sizes(256) + [320, 384, 448, 512]
    assert graph_sizes(8, 20) == cuda_graph_sizes(8) + [16, 20]
    # One request verifying 8 drafts (9 rows) pads to 16, not to a 64-row graph.
    assert graph_sizes(8, 72) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72]
    assert graph_sizes(4, 130) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 130]


def test_verify_batches_have_graphs_of_their_own() -> None:
    """Verify graphs (row groups in the decode attention) go up to the rows a verify batch can
    have; plain decode steps keep the graphs an engine without speculation has (the grouped kernel
    with its splits chosen for groups made a speculating engine's plain steps at batch 64 slower
    and numerically different: 55 of 64 greedy answers parted on an H100)."""
    from ember.engine.cuda_graphs import cuda_graph_sizes, verify_graph_sizes

    assert verify_graph_sizes(256, 0) == []
    assert verify_graph_sizes(256, 144) == cuda_graph_sizes(144)
    assert verify_graph_sizes(8, 72) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72]
    assert verify_graph_sizes(64, 320) == cuda_graph_sizes(64) + [128, 192, 256, 320]


def test_abort_while_verifying_frees_every_block(llama: Path) -> None:
    """A client that hangs up while its request's drafts are being verified (or its step is in
    flight): every block comes back, and the other request finishes as without speculation."""
    ps = prompts(2, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = LLM(str(llama), dtype="float32", block_size=4, async_scheduling=True)
    want = run(base, ps, [params] * 2)
    reference = {tuple(p): w[0] for p, w in zip(ps, want, strict=True)}
    llm = speculating(llama, Oracle(reference, corrupt=2), block_size=4, async_scheduling=True)
    engine = llm.engine
    engine.add_request("leaves", ps[0], params)
    engine.add_request("stays", ps[1], params)
    done = {}
    for _ in range(4):
        for out in engine.step():
            done[out.request_id] = out
    assert llm.engine.core.stats().spec_drafts > 0  # it was speculating when it left
    engine.abort_request("leaves")
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done["stays"].finished and done["stays"].outputs[0].token_ids == want[1][0]
    assert_pool_whole(llm)


def test_graph_rows_are_matched_to_their_requests(llama: Path) -> None:
    """The CUDA-graph path's row bookkeeping, on the CPU with a stand-in for the graphs: a decode,
    a one-token prompt chunk that samples nothing, and a verification of two drafts replay as
    one row each and three rows; each request gets the samples of its own rows."""
    from ember.engine.request import Request
    from ember.engine.scheduler import SchedulerOutput

    llm = LLM(str(llama), dtype="float32")
    runner = llm.engine.core.runner
    vocab = llm.engine.core.model_config.vocab_size

    class Graphs:
        graphs = {8: None}

        def size_for(self, n: int, verifying: bool = False) -> int:
            return 8

        def stage(self, so, order, size, prev_rows):  # type: ignore[no-untyped-def]
            return 5

        def staged(self, size, verifying, with_buffers):  # type: ignore[no-untyped-def]
            from ember.engine.step_plan import GraphInputs

            return GraphInputs(size, verifying, b"", b"", 0)

        def launch(self, size, verifying=False):  # type: ignore[no-untyped-def]
            assert verifying  # a verification is in the batch: the verify graphs replay
            return torch.nn.functional.one_hot(torch.arange(size) + 100, vocab).float()

    runner.graphs = Graphs()
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    reqs = [
        Request(f"r{i}", [1, 2, 3, 4], greedy, frozenset(), 10, output_token_ids=[5])
        for i in range(3)
    ]
    for r in reqs:
        r.all_token_ids = [1, 2, 3, 4, 5]
    so = SchedulerOutput(
        requests=reqs,
        num_scheduled_tokens=[1, 1, 3],
        block_ids=[[0], [1], [2]],
        num_computed_tokens=[4, 2, 4],
        samples=[True, False, True],
        spec_token_ids=[[], [], [102, 999]],
    )
    out = runner.finish(runner.launch(so))
    assert out.sampled == [100, None, 103]  # rows 0 | 1 (skipped) | 2, 3, 4
    assert out.accepted == [[], [], [102]]
