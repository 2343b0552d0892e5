"""Kimi K2 tool calls through a real `ember serve` on the tiny kimi_k2 checkpoint (tiktoken.model,
Kimi's chat template) with `--tool-call-parser kimi_k2`: the random model, held by a grammar
(vLLM's `structured_outputs`) to Kimi's call markers, answers with OpenAI `tool_calls`, whole and
streamed, and the call goes back into the next prompt as Kimi's template writes it."""

from __future__ import annotations

import json

import httpx
import pytest

from ember.tokenizer.tokenizer import Tokenizer
from tests.server.conftest import Server

SCHEMA = {
    "type": "object",
    "properties": {"path": {"enum": ["README.md", "setup.py"]}},
    "required": ["path"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "read_file", "description": "Read a file.", "parameters": SCHEMA},
    }
]
MSGS = [{"role": "user", "content": "What is in the README?"}]


@pytest.fixture(scope="module")
def kimi(server_factory) -> Server:
    return server_factory("--tool-call-parser", "kimi_k2", arch="kimi_k2")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir("kimi_k2"))


def kimi_call_grammar(tokenizer: Tokenizer) -> str:
    """One call in Kimi's format; the markers are special tokens, named by id."""

    def tag(name: str) -> str:
        return f"<[{tokenizer.token_to_id(f'<|{name}|>')}]>"

    return (
        f"start: {tag('tool_calls_section_begin')} {tag('tool_call_begin')} "
        f'"functions.read_file:0" {tag("tool_call_argument_begin")} args '
        f"{tag('tool_call_end')} {tag('tool_calls_section_end')}\n"
        # Compact JSON: a random model left free to emit whitespace spends its budget on it.
        f"args: %json {json.dumps({**SCHEMA, 'x-guidance': {'whitespace_flexible': False}})}\n"
    )


def request(tokenizer: Tokenizer, **kw) -> dict:
    return {
        "model": "tiny",
        "messages": MSGS,
        "tools": TOOLS,
        "max_tokens": 60,
        "structured_outputs": {"grammar": kimi_call_grammar(tokenizer)},
        **kw,
    }


def test_a_call_comes_back_parsed_and_goes_into_the_next_prompt(
    kimi: Server, tokenizer: Tokenizer
) -> None:
    r = httpx.post(f"{kimi.base}/chat/completions", json=request(tokenizer), timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "functions.read_file:0"
    assert call["function"]["name"] == "read_file"
    args = json.loads(call["function"]["arguments"])
    assert args["path"] in ("README.md", "setup.py")

    # The next turn's prompt carries the call and its result as Kimi's template writes them.
    msgs = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "# tiny"},
    ]
    r = httpx.post(f"{kimi.url}/tokenize", json={"model": "tiny", "messages": msgs, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(msgs, tools=TOOLS)
    assert (
        "<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>"
        f"{call['function']['arguments']}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.read_file:0\n# tiny<|im_end|>"
    ) in text
    assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_a_streamed_call_arrives_as_openai_deltas(kimi: Server, tokenizer: Tokenizer) -> None:
    body = request(tokenizer, stream=True, seed=1)
    chunks = []
    with httpx.stream("POST", f"{kimi.base}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    calls: dict[int, dict] = {}
    content = ""
    for ch in chunks:
        delta = ch["choices"][0]["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            entry = calls.setdefault(tc["index"], {"id": None, "name": None, "args": ""})
            entry["id"] = tc.get("id") or entry["id"]
            entry["name"] = tc["function"].get("name") or entry["name"]
            entry["args"] += tc["function"].get("arguments") or ""
    assert content == ""  # the markers never leak into the text
    assert list(calls) == [0]
    assert calls[0]["id"] == "functions.read_file:0" and calls[0]["name"] == "read_file"
    assert json.loads(calls[0]["args"])["path"] in ("README.md", "setup.py")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


TWO_TOOLS = [
    *TOOLS,
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "parameters": {
                "type": "object",
                "properties": {"depth": {"enum": [1, 2]}},
                "required": ["depth"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "list_dir"}}]
)
def test_tool_choice_required_and_named_force_a_kimi_call(kimi: Server, choice) -> None:
    """The server's own grammar for Kimi's format (no structured_outputs from the client): a
    required choice gets a call to one of the tools, a named one a call to that tool, arguments
    held to the tool's schema, parsed back into OpenAI tool_calls."""
    body = {
        "model": "tiny",
        "messages": MSGS,
        "tools": TWO_TOOLS,
        "tool_choice": choice,
        "max_tokens": 80,
        "seed": 3,
    }
    r = httpx.post(f"{kimi.base}/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice_out = r.json()["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls", choice_out
    calls = choice_out["message"]["tool_calls"]
    assert calls
    for call in calls:
        fn = call["function"]
        assert fn["name"] in ("read_file", "list_dir")
        args = json.loads(fn["arguments"])
        if fn["name"] == "read_file":
            assert args["path"] in ("README.md", "setup.py")
        else:
            assert args["depth"] in (1, 2)
        assert call["id"].startswith(f"functions.{fn['name']}:")
    if isinstance(choice, dict):
        assert [c["function"]["name"] for c in calls] == ["list_dir"]


def test_hostile_forced_calls_are_400_and_the_server_lives(kimi: Server) -> None:
    """A tool schema llguidance cannot compile, a name that no tool has, and a tool name that
    would break out of the grammar's string are refused with OpenAI errors; the server answers
    the next request."""
    bad_schema = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
        }
    ]
    quoted = [{"type": "function", "function": {"name": 'f" | /.*/ "'}}]
    cases = [
        {"tools": bad_schema, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": quoted, "tool_choice": "required"},
    ]
    for case in cases:
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 4, **case}
        r = httpx.post(f"{kimi.base}/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (case, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(
        f"{kimi.base}/chat/completions",
        json={"model": "tiny", "messages": MSGS, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200
