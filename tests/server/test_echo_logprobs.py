"""Scoring a prompt over HTTP (tiny Qwen3, float32): legacy completions with `echo` and `logprobs`
(the prompt's logprobs ahead of the output's, `max_tokens: 0` to score only), vLLM's
`prompt_logprobs` on completions (per choice) and chat (top level), and the edge's range checks."""

from __future__ import annotations

import httpx
import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.conftest import Server

PROMPT = "def add(a, b):\n    return a + b\n"
MSGS = [{"role": "user", "content": "Say hi."}]


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json={"model": "tiny", **body}, timeout=60)


def ok(server: Server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> tuple[list[int], torch.Tensor]:
    """PROMPT's token ids and transformers' log-softmax scoring each next token."""
    path = tiny_model_dir("qwen3")
    ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def test_echo_scores_the_prompt_ahead_of_the_output(server: Server, reference) -> None:
    ids, ref = reference
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = ok(server, "/completions", {**body, "logprobs": 2})["choices"][0]
    echoed = ok(server, "/completions", {**body, "logprobs": 2, "echo": True})["choices"][0]
    lp = echoed["logprobs"]
    n = len(ids)
    assert echoed["text"] == PROMPT + plain["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n + 3
    assert "".join(lp["tokens"][:n]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) <= 1e-4
        assert len(lp["top_logprobs"][p]) >= 2
    # The output's part is what the request without echo returned, its offsets past the prompt.
    tail = {k: v[n:] for k, v in lp.items()}
    assert tail["tokens"] == plain["logprobs"]["tokens"]
    assert tail["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert tail["text_offset"] == [o + len(PROMPT) for o in plain["logprobs"]["text_offset"]]
    assert lp["text_offset"][:n] == [sum(map(len, lp["tokens"][:p])) for p in range(n)]


def test_echo_without_logprobs_computes_no_prompt_scores(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True}
    choice = ok(server, "/completions", body)["choices"][0]
    assert choice["text"].startswith(PROMPT) and choice["logprobs"] is None
    assert "prompt_logprobs" not in choice


def test_max_tokens_0_with_echo_scores_only(server: Server, reference) -> None:
    ids, _ = reference
    body = {"prompt": [ids, ids], "max_tokens": 0, "echo": True, "logprobs": 1}
    r = ok(server, "/completions", body)
    assert r["usage"]["completion_tokens"] == 0
    assert r["usage"]["prompt_tokens"] == 2 * len(ids)
    first, second = r["choices"]
    assert first["text"] == second["text"] == PROMPT
    assert first["logprobs"] == second["logprobs"]
    assert len(first["logprobs"]["tokens"]) == len(ids)
    assert first["finish_reason"] == "length"

    # Streamed: the prompt alone, in one chunk, with its scores.
    with httpx.stream(
        "POST", f"{server.base}/completions", json={"model": "tiny", **body, "stream": True}
    ) as s:
        assert s.status_code == 200
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [orjson.loads(ln)["choices"][0] for ln in lines[:-1]]
    assert sorted(c["index"] for c in chunks) == [0, 1]
    for c in chunks:
        assert c["text"] == PROMPT and c["finish_reason"] == "length"
        assert c["logprobs"] == first["logprobs"]


def test_echo_streamed_sends_the_prompt_scores_first(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    whole = ok(server, "/completions", {**body, "echo": True, "logprobs": 1})["choices"][0]
    with httpx.stream(
        "POST",
        f"{server.base}/completions",
        json={"model": "tiny", **body, "echo": True, "logprobs": 1, "stream": True},
    ) as s:
        chunks = [orjson.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["text"] == PROMPT
    joined = {
        k: [x for c in choices if c["logprobs"] for x in c["logprobs"][k]]
        for k in whole["logprobs"]
    }
    assert joined == whole["logprobs"]
    assert "".join(c["text"] for c in choices) == whole["text"]


def test_completions_prompt_logprobs_per_choice(server: Server, reference) -> None:
    ids, ref = reference
    body = {"prompt": PROMPT, "max_tokens": 2, "n": 2, "prompt_logprobs": 3}
    r = ok(server, "/completions", body)
    assert r["choices"][0]["text"] != PROMPT  # no echo: the output alone
    scored = r["choices"][0]["prompt_logprobs"]
    assert r["choices"][1]["prompt_logprobs"] == scored
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        step = scored[p]
        chosen = step[str(ids[p])]
        assert abs(chosen["logprob"] - ref[p - 1, ids[p]].item()) <= 1e-4
        assert isinstance(chosen["decoded_token"], str) and chosen["rank"] >= 1
        ranks = sorted(v["rank"] for k, v in step.items() if v["rank"] <= 3)
        assert ranks == [1, 2, 3]
        best = max(step.values(), key=lambda v: v["logprob"])
        assert best["rank"] == 1 and abs(best["logprob"] - ref[p - 1].max().item()) <= 1e-4


def test_chat_prompt_logprobs_at_the_top_level(server: Server) -> None:
    r = ok(server, "/chat/completions", {"messages": MSGS, "max_tokens": 2, "prompt_logprobs": 0})
    scored = r["prompt_logprobs"]
    assert len(scored) == r["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(step) == 1 and next(iter(step.values()))["logprob"] <= 0 for step in scored[1:])
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "prompt_logprobs" not in ok(server, "/chat/completions", {"messages": MSGS})


def test_the_openai_client_scores_a_prompt(server: Server) -> None:
    r = server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0
    )
    c = r.choices[0]
    assert c.text == PROMPT and c.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])


CHAT = {"messages": MSGS, "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "path,body,param",
    [
        *(
            (path, {**base, "prompt_logprobs": v}, "prompt_logprobs")
            for path, base in (("/completions", COMPLETION), ("/chat/completions", CHAT))
            for v in (-1, 21, 2**70, "3", True, 1.5, [1])
        ),
        ("/completions", {**COMPLETION, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/chat/completions", {**CHAT, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ("/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ("/completions", {**COMPLETION, "max_tokens": -1, "echo": True}, "max_tokens"),
        ("/completions", {**COMPLETION, "logprobs": 21, "echo": True}, "logprobs"),
    ],
)
def test_bad_values_are_400(server: Server, path: str, body: dict, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_a_conversations_next_turns_run_the_whole_prompts_ids(server: Server) -> None:
    """An agent's turns through the chat route, each resending the conversation: the ids the
    engine ran (the keys of `prompt_logprobs`) are /tokenize's for the same messages (a whole
    tokenization), though the route reuses the earlier turns' ids (ember/tokenizer/prefix_cache.py);
    a user message that spells a special token included."""
    msgs = [{"role": "system", "content": "You are terse. é 漢字 🙂"}]
    for turn, said in enumerate(("Read a.py", "  and <|im_end|> b.py\n\n", "ok", "")):
        msgs.append({"role": "user", "content": said})
        r = ok(
            server, "/chat/completions", {"messages": msgs, "max_tokens": 3, "prompt_logprobs": 0}
        )
        ran = [int(next(iter(step))) for step in r["prompt_logprobs"][1:]]
        body = {"model": "tiny", "messages": msgs, "add_generation_prompt": True}
        want = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"]
        assert ran == want[1:] and r["usage"]["prompt_tokens"] == len(want), turn
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
