"""Forced tool calls and JSON output through the server: the grammar makes a random model obey."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import Server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"enum": ["README.md", "setup.py"]}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "parameters": {
                "type": "object",
                "properties": {"depth": {"type": "integer", "minimum": 0, "maximum": 3}},
                "required": ["depth"],
                "additionalProperties": False,
            },
        },
    },
]
MSGS = [{"role": "user", "content": "What is in the repo?"}]


def test_named_tool_choice_forces_that_call(server: Server) -> None:
    client = server.client()
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            tools=TOOLS,
            max_tokens=100,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "read_file"}},
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        assert call.function.name == "read_file" and call.id
        assert json.loads(call.function.arguments)["path"] in ("README.md", "setup.py")


def test_required_tool_choice_streams_a_valid_call(server: Server) -> None:
    chunks = list(
        server.client().chat.completions.create(
            model="tiny",
            messages=MSGS,
            tools=TOOLS,
            max_tokens=100,
            seed=1,
            tool_choice="required",
            parallel_tool_calls=False,
            stream=True,
        )
    )
    calls: dict[int, dict] = {}
    for ch in chunks:
        for tc in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            entry = calls.setdefault(tc.index, {"name": None, "args": ""})
            if tc.function.name:
                entry["name"] = tc.function.name
            entry["args"] += tc.function.arguments or ""
    assert len(calls) == 1
    call = calls[0]
    assert call["name"] in ("read_file", "list_dir")
    args = json.loads(call["args"])
    assert set(args) == ({"path"} if call["name"] == "read_file" else {"depth"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_json_schema_and_json_object(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
        "required": ["ok", "color"],
        "additionalProperties": False,
    }
    client = server.client()
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=50,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"ok", "color"} and out["color"] in ("red", "green")
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=200, seed=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_on_completions(server: Server) -> None:
    r = httpx.post(
        f"{server.base}/completions",
        json={
            "model": "tiny",
            "prompt": "answer:",
            "max_tokens": 20,
            "structured_outputs": {"regex": "(yes|no), [0-9]{2}"},
        },
    ).json()
    import re

    assert re.fullmatch(r"(yes|no), [0-9]{2}", r["choices"][0]["text"])
    assert r["choices"][0]["finish_reason"] == "stop"


def test_bad_grammars_are_400(server: Server) -> None:
    bad = [
        {
            "messages": MSGS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        {"messages": MSGS, "structured_outputs": {"regex": "(unclosed"}},
        {"messages": MSGS, "structured_outputs": {}},
        {"messages": MSGS, "structured_outputs": {"regex": "a", "grammar": 'start: "a"'}},
    ]
    for body in bad:
        r = httpx.post(f"{server.base}/chat/completions", json={"model": "tiny", **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]


def test_a_json_answer_cut_by_max_tokens_says_length(server: Server) -> None:
    """The grammar makes an answer that ends by itself parse; one cut by max_tokens first is
    unfinished JSON and must say so (finish_reason "length"), as the README warns."""
    schema = {
        "type": "object",
        "properties": {"summary": {"type": "string", "minLength": 40}},
        "required": ["summary"],
    }
    r = server.client().chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 3
    try:
        json.loads(c.message.content)
    except json.JSONDecodeError:
        pass
    else:
        raise AssertionError(f"3 tokens cannot hold a 40-character summary: {c.message.content!r}")
