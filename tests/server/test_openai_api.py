"""The official `openai` client against a real `ember serve` on loopback (tiny Qwen3)."""

from __future__ import annotations

import httpx

from ember.trust import internal_headers
from tests.server.conftest import Server
from tests.servers import SECRET

MSGS = [{"role": "user", "content": "Write a function that adds two numbers."}]


def test_models_lists_the_served_name(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_not_streamed(server: Server) -> None:
    r = server.client().chat.completions.create(model="tiny", messages=MSGS, max_tokens=8)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streamed_equals_not_streamed_and_reports_usage(server: Server) -> None:
    client = server.client()
    kw = dict(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_n_2_gives_two_indexed_choices(server: Server) -> None:
    client = server.client()
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, n=2, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    streamed = list(
        client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=6, n=2, seed=7, stream=True
        )
    )
    per_index: dict[int, str] = {0: "", 1: ""}
    for ch in streamed:
        for c in ch.choices:
            per_index[c.index] += c.delta.content or ""
    assert per_index == {c.index: c.message.content for c in r.choices}


def test_seeded_sampling_is_reproducible(server: Server) -> None:
    client = server.client()
    kw = dict(model="tiny", messages=MSGS, max_tokens=10, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    c = client.chat.completions.create(**{**kw, "seed": 99}).choices[0].message.content
    assert a == b and a != c


def test_stop_strings_cut_streamed_and_whole_text_alike(server: Server) -> None:
    client = server.client()
    kw = dict(model="tiny", prompt="def main():", max_tokens=30, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 10
    stop = full[5:8]
    cut = full[: full.index(stop)]
    whole = client.completions.create(**kw, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**kw, stop=[stop], stream=True)
        if c.choices
    )
    assert streamed == cut


def test_completions_with_token_ids_and_batches(server: Server) -> None:
    client = server.client()
    r = client.completions.create(
        model="tiny", prompt=[10, 20, 30, 40], max_tokens=5, temperature=0
    )
    assert r.object == "text_completion" and r.usage.prompt_tokens == 4
    batch = client.completions.create(
        model="tiny", prompt=[[10, 20, 30, 40], [50, 60]], max_tokens=5, temperature=0, n=2
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    # Greedy: both samples of the first prompt equal the single request's text.
    texts = {c.index: c.text for c in batch.choices}
    assert texts[0] == texts[1] == r.choices[0].text
    assert batch.usage.prompt_tokens == 6


def test_completion_logprobs_and_echo(server: Server) -> None:
    client = server.client()
    r = client.completions.create(
        model="tiny", prompt="import os", max_tokens=4, logprobs=2, echo=True, temperature=0
    )
    c = r.choices[0]
    assert c.text.startswith("import os")
    # vLLM's echo: the prompt's two tokens lead (the first has no logprob), then the output's four.
    assert c.logprobs.tokens[:2] == ["import", " os"]
    assert len(c.logprobs.tokens) == 6 and len(c.logprobs.token_logprobs) == 6
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])
    assert all(len(t) >= 2 for t in c.logprobs.top_logprobs[1:])


def test_chat_logprobs(server: Server) -> None:
    r = server.client().chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=3, logprobs=True, top_logprobs=2, temperature=0
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for item in content:
        assert len(item.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == item.top_logprobs[0].logprob


def test_second_turn_reports_cached_prompt_tokens(server: Server) -> None:
    client = server.client()
    history = [
        {"role": "system", "content": "You are a careful agent. " * 40},
        {"role": "user", "content": "List the files."},
    ]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    assert first.usage.prompt_tokens > 100
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or "ok"},
        {"role": "user", "content": "Now read README.md."},
    ]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 96, cached
    streamed = list(
        client.chat.completions.create(
            model="tiny",
            messages=history,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= cached


def test_health_load_and_metrics(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    load = server.load()
    for key in ("running", "waiting", "prefill_tokens", "decode_tokens", "kv_usage"):
        assert key in load
    server.client().chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    text = httpx.get(f"{server.url}/metrics", headers=internal_headers(SECRET)).text
    for name in (
        "ember:time_to_first_token_seconds_count",
        "ember:inter_token_latency_seconds_count",
        "ember:e2e_request_latency_seconds_count",
        "ember:num_requests_running",
        "ember:num_requests_waiting",
        "ember:kv_cache_usage_perc",
        "ember:prefix_cache_queries_total",
        "ember:prefix_cache_hits_total",
        "ember:prompt_tokens_total",
        "ember:generation_tokens_total",
    ):
        assert name in text, name
    ttft = [
        ln for ln in text.splitlines() if ln.startswith("ember:time_to_first_token_seconds_count")
    ]
    assert float(ttft[0].split()[-1]) >= 1
