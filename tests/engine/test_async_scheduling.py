"""Async scheduling (step N+1 launched before step N's tokens reach the host) gives exactly what the
synchronous engine gives, whatever ends a request, and frees every block. On the CPU the launch
itself blocks, but the bookkeeping (placeholders, tokens fed from the last step, late stops) is the
same code the GPU runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 3000, (9 + 5 * i,), generator=g).tolist() for i in range(n)]


def mixed_params(stop_id: int) -> list[SamplingParams]:
    """One request per way of ending or sampling."""
    return [
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, max_tokens=23, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=3, logprobs=2),
        SamplingParams(temperature=1.0, max_tokens=30, seed=11, min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=1.0, max_tokens=14, seed=5, repetition_penalty=1.3),
    ]


def run(llm: LLM, ps: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Per request: tokens, finish reason, stop reason and logprobs (as {token: logprob} steps)."""
    outs = llm.generate(ps, params)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            None
            if o.outputs[0].logprobs is None
            else [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def assert_same(got: list[tuple], want: list[tuple]) -> None:
    """Tokens and reasons exactly; logprobs to 1e-4 (steps batch differently, so float sums may
    round differently)."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want, strict=True):
        if w[3] is None:
            assert g[3] is None
            continue
        for gs, ws in zip(g[3], w[3], strict=True):
            assert gs.keys() == ws.keys()
            assert list(gs.values()) == pytest.approx(list(ws.values()), abs=1e-4)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4},  # chunked prefills beside decodes
        {"block_size": 4, "num_kv_blocks": 40, "max_model_len": 64},  # preemption
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_async_equals_sync_token_for_token(llama: Path, kw: dict) -> None:
    sync = LLM(str(llama), dtype="float32", async_scheduling=False, **kw)
    ps = prompts(6, seed=1)
    # Request 4 stops on the third token it would produce greedily: an early, known stop.
    probe = sync.generate(ps[4], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    params = mixed_params(probe[0].outputs[0].token_ids[2])
    want = run(sync, ps, params)
    fast = LLM(str(llama), dtype="float32", async_scheduling=True, **kw)
    assert_same(run(fast, ps, params), want)
    core = fast.engine.core
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    if "num_kv_blocks" in kw:
        assert core.scheduler.num_preemptions > 0
    assert any(len(t) < p.max_tokens for (t, *_), p in zip(want, params, strict=True)), (
        "no request ended early: the late-stop path was not exercised"
    )


def test_next_step_is_launched_before_the_last_one_is_collected(llama: Path) -> None:
    llm = LLM(str(llama), dtype="float32", async_scheduling=True)
    runner = llm.engine.core.runner
    calls: list[str] = []
    launch, finish = runner.launch, runner.finish
    runner.launch = lambda so: (calls.append("launch"), launch(so))[1]
    runner.finish = lambda step: (calls.append("finish"), finish(step))[1]
    llm.generate(prompts(2, seed=2), SamplingParams(temperature=0.0, max_tokens=6))
    assert calls[:3] == ["launch", "launch", "finish"]
    assert calls.count("launch") == calls.count("finish")


def test_grammar_requests_wait_for_their_token(llama: Path) -> None:
    """A grammar's mask needs the last token on the host, so those steps run synchronously."""
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        }
    )
    params = SamplingParams(
        temperature=1.0, seed=4, max_tokens=40, structured_outputs=StructuredOutputsParams(schema)
    )
    ps = prompts(2, seed=3)
    want = LLM(str(llama), async_scheduling=False).generate(ps, params)
    got = LLM(str(llama), async_scheduling=True).generate(ps, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    for o in got:
        text, reason = o.outputs[0].text, o.outputs[0].finish_reason
        if reason == "stop":
            assert isinstance(json.loads(text)["a"], int)
        else:  # a random model may spell digits up to max_tokens: a prefix of such a document
            assert reason == "length"
            assert re.fullmatch(r'\{\s*"a"\s*:\s*-?\d*', text), text


def test_stop_strings_and_aborts_free_every_block(llama: Path) -> None:
    llm = LLM(str(llama), dtype="float32", async_scheduling=True)
    p = prompts(1, seed=4)[0]
    text = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0].text
    stop = text[5:8]
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))[0]
    assert out.outputs[0].text == text[: text.index(stop)]
    engine = llm.engine
    engine.add_request("a", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", prompts(1, seed=5)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.core._in_flight is not None
    engine.abort_request("a")
    engine.abort_request("b")
    while engine.has_unfinished_requests():  # collects the step still in flight
        engine.step()
    pool = engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_async_equals_sync_on_the_gpu(llama: Path, eager: bool) -> None:
    """On a GPU the step really is in flight while the next is prepared (CUDA graphs included)."""
    kw = dict(device="cuda", dtype="float32", enforce_eager=eager, num_kv_blocks=512, kv_host_gb=0)
    sync = LLM(str(llama), async_scheduling=False, **kw)
    ps = prompts(6, seed=1)
    probe = sync.generate(ps[4], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    params = mixed_params(probe[0].outputs[0].token_ids[2])
    want = run(sync, ps, params)
    fast = LLM(str(llama), async_scheduling=True, **kw)
    assert_same(run(fast, ps, params), want)
    pool = fast.engine.core.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
