"""Tool-call parsers: the stream, split anywhere, says what extract() says, and an OpenAI client
accumulates it into the same message."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from ember.server.tool_parsers import (
    HermesToolParser,
    KimiK2ToolParser,
    StreamDelta,
    ToolParser,
    get_tool_parser,
)

Calls = list[tuple[str, dict[str, Any]]]


@dataclass(slots=True)
class Case:
    name: str
    text: str
    content: str | None
    calls: Calls
    broken: int = 0
    """Calls the stream opened before they turned out malformed."""


def hermes_call(name: str, args: dict[str, Any], **dumps: Any) -> str:
    return (
        f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, **dumps)}}}\n</tool_call>'
    )


def kimi_call(name: str, args: dict[str, Any], idx: int, **dumps: Any) -> str:
    return (
        f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>"
        f"{json.dumps(args, **dumps)}<|tool_call_end|>"
    )


def kimi_section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


TRICKY = {
    "q": 'say "hi" {not a brace} [nor a bracket] \\ done',
    "nested": {"list": [1, 2.5, {"deep": [None, True, False]}], "empty": {}},
    "unicode": "héllo 日本語 🙂",
    "tags": "</tool_call> <tool_call> <|tool_call_begin|> <|tool_calls_section_end|>",
}
WEATHER = {"city": "Paris", "unit": "celsius"}

HERMES_CASES = [
    Case("plain", "The weather is nice today.\n", "The weather is nice today.\n", []),
    Case("one call", hermes_call("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    Case(
        "several calls",
        hermes_call("a", {"x": 1})
        + "\n"
        + hermes_call("b", {})
        + "\n\n"
        + hermes_call("c", {"y": [1]}),
        None,
        [("a", {"x": 1}), ("b", {}), ("c", {"y": [1]})],
    ),
    Case(
        "content then calls",
        "Let me check both.\n\n" + hermes_call("a", WEATHER) + "\n" + hermes_call("b", {"n": -1e3}),
        "Let me check both.",
        [("a", WEATHER), ("b", {"n": -1e3})],
    ),
    Case("tricky arguments", hermes_call("t", TRICKY), None, [("t", TRICKY)]),
    Case(
        "ascii-escaped arguments",
        "x " + hermes_call("t", TRICKY, ensure_ascii=True, indent=2),
        "x",
        [("t", TRICKY)],
    ),
    Case(
        "mentions the tag",
        "Use <tool> or <tool_ca to call; a < b and <tool_call> in prose, </tool_call>",
        "Use <tool> or <tool_ca to call; a < b and <tool_call> in prose, </tool_call>",
        [],
    ),
    Case(
        "unterminated call",
        "On it. " + hermes_call("f", {"a": "b"}).removesuffix("</tool_call>"),
        "On it.",
        [("f", {"a": "b"})],
    ),
    Case(
        "cut mid-tag",
        hermes_call("f", {"a": 1}).removesuffix("call>"),
        None,
        [("f", {"a": 1})],
    ),
    Case(
        "cut mid-arguments",
        'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "incompl',
        'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "incompl',
        [],
        broken=1,
    ),
    Case(
        "invalid json after a good call",
        hermes_call("g", {}) + '\n<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
        [("g", {})],
        broken=1,
    ),
    Case(
        "not json at all",
        "Hmm <tool_call>\nget_weather(city='Paris')\n</tool_call>",
        "Hmm <tool_call>\nget_weather(city='Paris')\n</tool_call>",
        [],
    ),
    Case(
        "arguments as a json string",
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, \\"}\\"]}"}\n</tool_call>',
        None,
        [("f", {"a": [1, "}"]})],
    ),
    Case(
        "keys in another order",
        '<tool_call>\n{"arguments": {"a": "é"}, "name": "f"}\n</tool_call>',
        None,
        [("f", {"a": "é"})],
    ),
    Case("no arguments", '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", {})]),
    Case(
        "content after the calls",
        "First: " + hermes_call("a", {}) + "\n\nDone <tool",
        "First:Done <tool",
        [("a", {})],
    ),
]

KIMI_CASES = [
    Case("plain", "Nothing to call. <|im_end", "Nothing to call. <|im_end", []),
    Case(
        "one call",
        kimi_section(kimi_call("get_weather", WEATHER, 0)),
        None,
        [("get_weather", WEATHER)],
    ),
    Case(
        "content then calls",
        "Checking both.\n"
        + kimi_section(kimi_call("a", WEATHER, 0), "\n", kimi_call("b.c", {"n": 2}, 1)),
        "Checking both.",
        [("a", WEATHER), ("b.c", {"n": 2})],
    ),
    Case("tricky arguments", kimi_section(kimi_call("t", TRICKY, 0)), None, [("t", TRICKY)]),
    Case(
        "spaced, ascii-escaped arguments",
        kimi_section(kimi_call("t", TRICKY, 3, indent=1).replace("begin|>{", "begin|> \n{")),
        None,
        [("t", TRICKY)],
    ),
    Case(
        "mentions the markers",
        "A <|tool_calls_section_begin in prose, <|tool_call_end|> and <tool_call>",
        "A <|tool_calls_section_begin in prose, <|tool_call_end|> and <tool_call>",
        [],
    ),
    Case(
        "unterminated call",
        "Ok "
        + kimi_section(kimi_call("f", {"a": 1}, 0)).removesuffix(
            "<|tool_call_end|><|tool_calls_section_end|>"
        ),
        "Ok",
        [("f", {"a": 1})],
    ),
    Case(
        "cut mid-arguments",
        'Ok <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a',
        'Ok <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a',
        [],
        broken=1,
    ),
    Case(
        "bad id, then a good call",
        "<|tool_calls_section_begin|><|tool_call_begin|>nonsense<|tool_call_argument_begin|>{}"
        "<|tool_call_end|>" + kimi_call("g", {}, 1) + "<|tool_calls_section_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>nonsense<|tool_call_argument_begin|>{}"
        "<|tool_call_end|>",
        [("g", {})],
    ),
    Case(
        "trailing junk after the arguments",
        kimi_section(kimi_call("f", {"a": 1}, 0).replace("}<|tool_call_end", "}}<|tool_call_end")),
        kimi_section(kimi_call("f", {"a": 1}, 0).replace("}<|tool_call_end", "}}<|tool_call_end")),
        [],
        broken=1,
    ),
]

ALL_CASES = [(HermesToolParser, c) for c in HERMES_CASES] + [
    (KimiK2ToolParser, c) for c in KIMI_CASES
]
CASE_IDS = [f"{cls.__name__}:{case.name}" for cls, case in ALL_CASES]


@dataclass(slots=True)
class Streamed:
    content: str
    calls: list[dict[str, str]]  # by index: id, name, arguments
    deltas: list[StreamDelta]


def stream(parser_cls: type[ToolParser], pieces: list[str]) -> Streamed:
    """Feed the pieces and finish, checking the delta rules OpenAI clients rely on."""
    parser = parser_cls()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        for d in delta.tool_calls:
            if d.index == len(calls):
                assert d.id and d.name, "a call's first delta carries its id and name"
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:
                assert d.index == len(calls) - 1, "indices count up, one call at a time"
                assert d.id is None and d.name is None, "id and name come once"
                calls[d.index]["arguments"] += d.arguments
    return Streamed(content, calls, deltas)


def parses(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def check_stream(parser_cls: type[ToolParser], text: str, pieces: list[str]) -> Streamed:
    """The stream agrees with extract(): same content; the same calls, plus any the stream opened
    before they turned out malformed, whose arguments then never parse."""
    assert "".join(pieces) == text
    whole = parser_cls().extract(text)
    got = stream(parser_cls, pieces)
    assert got.content == (whole.content or "")
    good = [c for c in got.calls if parses(c["arguments"])]
    assert [(c["name"], c["arguments"]) for c in good] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ]
    if parser_cls is KimiK2ToolParser:
        assert [c["id"] for c in good] == [c.id for c in whole.tool_calls]
    return got


def splits(text: str) -> list[list[str]]:
    """Every 2-split, and char by char."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def random_split(data: st.DataObject, text: str, max_cuts: int = 10) -> list[str]:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=max_cuts).map(sorted))
    return [text[a:b] for a, b in pairwise([0, *cuts, len(text)])]


@pytest.mark.parametrize(("parser_cls", "case"), ALL_CASES, ids=CASE_IDS)
def test_extract(parser_cls: type[ToolParser], case: Case) -> None:
    got = parser_cls().extract(case.text)
    assert got.content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == case.calls
    for call in got.tool_calls:
        if parser_cls is HermesToolParser:
            assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
        else:
            assert re.fullmatch(rf"functions\.{re.escape(call.name)}:\d+", call.id)


@pytest.mark.parametrize(("parser_cls", "case"), ALL_CASES, ids=CASE_IDS)
def test_stream_at_every_split(parser_cls: type[ToolParser], case: Case) -> None:
    for pieces in splits(case.text):
        got = check_stream(parser_cls, case.text, pieces)
        assert len(got.calls) == len(case.calls) + case.broken


@pytest.mark.parametrize(("parser_cls", "case"), ALL_CASES, ids=CASE_IDS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_stream_at_random_splits(
    parser_cls: type[ToolParser], case: Case, data: st.DataObject
) -> None:
    check_stream(parser_cls, case.text, random_split(data, case.text, max_cuts=12))


def test_arguments_stream_before_the_call_ends() -> None:
    text = hermes_call("write", {"path": "a.py", "body": "x = 1\n" * 20})
    parser = HermesToolParser()
    cut = text.index("x = 1") + 30
    early = parser.feed(text[:cut])
    assert [(d.index, d.name) for d in early.tool_calls] == [(0, "write")]
    assert early.tool_calls[0].arguments == text[text.index('{"path"') : cut]
    assert not parser.feed(text[cut:]).content


def test_broken_call_never_parses() -> None:
    """A call opened on the stream and then cut off keeps arguments that are not valid JSON."""
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": {"b": 1}}'
    got = stream(HermesToolParser, [text])
    assert [c["name"] for c in got.calls] == ["f"]
    assert got.calls[0]["arguments"] == '{"a": {"b": 1}'
    assert got.content == text


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
    )


def to_chunks(deltas: list[StreamDelta]) -> list[ChatCompletionChunk]:
    """Chunks as the server sends them: a tool call's id, type and name only on its first delta."""
    chunks = [chunk({"role": "assistant", "content": ""})]
    any_calls = False
    for delta in deltas:
        body: dict[str, Any] = {}
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            any_calls = True
            body["tool_calls"] = []
            for d in delta.tool_calls:
                call: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
                if d.id is not None:
                    call |= {"id": d.id, "type": "function"}
                    call["function"]["name"] = d.name
                body["tool_calls"].append(call)
        if body:
            chunks.append(chunk(body))
    chunks.append(chunk({}, "tool_calls" if any_calls else "stop"))
    return chunks


@pytest.mark.parametrize(("parser_cls", "case"), ALL_CASES, ids=CASE_IDS)
def test_openai_client_accumulates_the_stream(parser_cls: type[ToolParser], case: Case) -> None:
    got = stream(parser_cls, list(case.text))
    state = ChatCompletionStreamState()
    for c in to_chunks(got.deltas):
        state.handle_chunk(c)
    message = state.get_final_completion().choices[0].message
    assert (message.content or "") == (case.content or "")
    calls = [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []]
    assert calls == [(c["id"], c["name"], c["arguments"]) for c in got.calls]
    assert [(n, json.loads(a)) for _, n, a in calls if parses(a)] == case.calls


PLAIN = st.lists(
    st.sampled_from([*"ab <>/_|{}\"'\\:,\n", "é", "🙂", "<tool", "<tool_call", "<|tool_call"])
).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=PLAIN, parser_cls=st.sampled_from([HermesToolParser, KimiK2ToolParser]))
def test_plain_text_passes_through(text: str, parser_cls: type[ToolParser]) -> None:
    if parser_cls.start_tag in text:
        return
    assert parser_cls().extract(text).tool_calls == []
    assert parser_cls().extract(text).content == (text or None)
    got = stream(parser_cls, list(text))
    assert got.content == text and got.calls == []


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
NAMES = st.from_regex(r"[a-z_][a-z0-9_.]{0,12}", fullmatch=True)
ARGS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
PROSE = st.text(st.sampled_from(list("ab .<>\n")), max_size=12)

HERMES_BITS = ["<tool_call>", "</tool_call>", "<tool_", '{"name": "f", "arguments": ', "\n"]
KIMI_BITS = [
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "functions.f:0",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
    "<|tool_ca",
]
JSON_BITS = ["{", "}", "[", "]", '"', "\\", ":", ",", " ", "1", "a", '"k": ', "é"]


@st.composite
def outputs(draw: st.DrawFn, parser_cls: type[ToolParser]) -> str:
    """Prose, calls, calls with a slice cut out or junk let in, and markup noise, in any order."""
    bits = (HERMES_BITS if parser_cls is HermesToolParser else KIMI_BITS) + JSON_BITS
    noise = st.lists(st.sampled_from(bits), max_size=6).map("".join)
    parts = []
    for kind in draw(st.lists(st.sampled_from(["call", "damaged", "noise", "prose"]), max_size=6)):
        if kind == "noise":
            parts.append(draw(noise))
        elif kind == "prose":
            parts.append(draw(PROSE))
        else:
            name, args, ascii_only = draw(NAMES), draw(ARGS), draw(st.booleans())
            if parser_cls is HermesToolParser:
                call = hermes_call(name, args, ensure_ascii=ascii_only)
            else:
                call = kimi_call(name, args, len(parts), ensure_ascii=ascii_only)
            if kind == "damaged":
                i = draw(st.integers(0, len(call)))
                j = draw(st.integers(i, len(call)))
                call = call[:i] + draw(noise) + call[j:]
            parts.append(call)
    return "".join(parts)


@settings(max_examples=400, deadline=None)
@given(data=st.data(), parser_cls=st.sampled_from([HermesToolParser, KimiK2ToolParser]))
def test_any_output_streams_as_extracted(data: st.DataObject, parser_cls: type[ToolParser]) -> None:
    text = data.draw(outputs(parser_cls))
    check_stream(parser_cls, text, random_split(data, text))
    check_stream(parser_cls, text, list(text))


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    parser_cls=st.sampled_from([HermesToolParser, KimiK2ToolParser]),
    prose=PROSE,
    calls=st.lists(st.tuples(NAMES, ARGS), max_size=3),
    ascii_only=st.booleans(),
)
def test_generated_calls_round_trip(
    data: st.DataObject,
    parser_cls: type[ToolParser],
    prose: str,
    calls: Calls,
    ascii_only: bool,
) -> None:
    if parser_cls is HermesToolParser:
        blocks = [hermes_call(n, a, ensure_ascii=ascii_only) for n, a in calls]
        text = prose + "\n".join(blocks)
    else:
        blocks = [kimi_call(n, a, i, ensure_ascii=ascii_only) for i, (n, a) in enumerate(calls)]
        text = prose + (kimi_section(*blocks) if blocks else "")
    whole = parser_cls().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert whole.content == ((prose.rstrip() if calls else prose) or None)
    got = check_stream(parser_cls, text, random_split(data, text))
    assert len(got.calls) == len(calls)


def test_registry() -> None:
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("kimi_k2") is KimiK2ToolParser
    with pytest.raises(ValueError, match="hermes, kimi_k2"):
        get_tool_parser("llama3_json")


def test_skip_special_tokens() -> None:
    assert HermesToolParser().adjust_skip_special_tokens() is None
    assert KimiK2ToolParser().adjust_skip_special_tokens() is False
