"""Speculation where KV comes from elsewhere: the decode engine of a disaggregated pair speculates
on KV it read from the prefill engine, and an engine speculates on prompts whose blocks come from
the prefix cache and the host tier; greedy output is the output without speculation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from ember import LLM, SamplingParams
from ember.spec_decode.config import SpeculativeConfig
from ember.trust import internal_headers
from tests.servers import SECRET, pd_cluster, start_server

ENGINE = ("--cpu-threads", "1", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def greedy_body(prompt: list[int]) -> dict:
    """A greedy completion of 24 tokens of `prompt` (token ids) on the tiny model."""
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }


def completion(url: str, prompt: list[int]) -> list[int]:
    body = {**greedy_body(prompt), "logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def drafts_of(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=internal_headers(SECRET), timeout=30).text
    for line in text.splitlines():
        if line.startswith("ember:spec_decode_num_drafts_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no ember:spec_decode_num_drafts_total on /metrics:\n{text[:2000]}")


def test_decode_engine_speculates_on_transferred_kv(llama: Path) -> None:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    # Each prompt twice: the decode engine's suffix tree drafts the second from the first.
    prompts = [[11, 12, 13, 14, 15] * 8, list(range(200, 230)) * 2] * 2
    plain = start_server(llama, *ENGINE)
    try:
        want = [completion(plain.url, p) for p in prompts]
    finally:
        plain.stop()
    with pd_cluster(llama, *ENGINE, "--speculative", "suffix", prefill=1) as pd:
        got = [completion(pd.router.url, p) for p in prompts]
        assert got == want
        assert drafts_of(pd.decode.url) > 0  # the decode side drafted and verified
        deadline = time.monotonic() + 10  # stats reach /load with the next step's outputs
        while (load := pd.decode.load())["free_blocks"] != load["total_blocks"]:
            assert time.monotonic() < deadline, load
            time.sleep(0.1)
        assert load["running"] == 0


def test_speculation_over_prefix_cache_and_host_tier_hits(llama: Path) -> None:
    """Each prompt twice with others between: the second time its blocks come back from the
    prefix cache or, evicted from a small GPU pool, from the host tier."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 3000, (96,), generator=g).tolist() for _ in range(6)]
    order = prompts + prompts
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, num_kv_blocks=80, max_model_len=256, kv_host_gb=0.05)
    base = LLM(str(llama), **kw)
    want = [base.generate([p], params)[0].outputs[0].token_ids for p in order]
    base.close()
    # The second run of a prompt is drafted from the first answer (the suffix tree of its
    # tenant): right drafts, so that speculation really runs on the loaded KV.
    llm = LLM(str(llama), speculative=SpeculativeConfig("suffix"), **kw)
    try:
        got = [llm.generate([p], params)[0].outputs[0].token_ids for p in order]
        assert got == want
        stats = llm.engine.core.stats()
        assert stats.spec_drafts > 0
        assert stats.kv_tiers["cpu"].hits > 0  # some prompt came back from the host tier
        assert stats.prefix_hits > 0
        pool = llm.engine.core.kv.pool
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        llm.close()


def test_usage_reports_accepted_and_rejected_draft_tokens(llama: Path) -> None:
    """With speculation on, every answer's usage says how many draft tokens stood and how many
    did not (OpenAI's predicted-output fields), streamed or not; a request that opts out, or a
    server without speculation, reports none."""
    prompt = [11, 12, 13, 14, 15] * 8
    body = greedy_body(prompt)
    server = start_server(llama, *ENGINE, "--speculative", "suffix")
    try:

        def usage(extra: dict, stream: bool = False) -> dict:
            req = {**body, **extra}
            if not stream:
                r = httpx.post(f"{server.url}/v1/completions", json=req, timeout=60)
                assert r.status_code == 200, r.text
                return r.json()["usage"]
            req.update(stream=True, stream_options={"include_usage": True})
            with httpx.stream("POST", f"{server.url}/v1/completions", json=req, timeout=60) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
            return json.loads(lines[-1][6:])["usage"]

        first = usage({})
        assert first["completion_tokens_details"]["accepted_prediction_tokens"] >= 0
        second = usage({})  # drafted from the first answer by the suffix tree
        details = second["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        assert details["accepted_prediction_tokens"] < second["completion_tokens"]
        streamed = usage({}, stream=True)["completion_tokens_details"]
        assert streamed["accepted_prediction_tokens"] > 0
        assert "completion_tokens_details" not in usage({"speculative": False})
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
            },
            timeout=60,
        ).json()["usage"]
        assert set(chat["completion_tokens_details"]) == {
            "accepted_prediction_tokens",
            "rejected_prediction_tokens",
        }
    finally:
        server.stop()
    plain = start_server(llama, *ENGINE)
    try:
        r = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60).json()
        assert "completion_tokens_details" not in r["usage"]
    finally:
        plain.stop()
