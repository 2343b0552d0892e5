"""Hostile request bodies for the engine's two generation routes: huge and negative integers,
NaN / infinity, lone surrogates, deep nesting, huge arrays and wrong types on every field.
Each one must get a 400 (OpenAI-shaped, no traceback), never a 5xx, and never harm the server;
only the cases named in MAY_SUCCEED are valid requests (a null optional field, an in-range seed,
a client's kv_transfer_params, which the engine drops) and may get a 200."""

from __future__ import annotations

import json
from typing import Any

BIG = [2**31, 2**63, 2**64 - 1, 2**70, -(2**63) - 1, 10**400]
"""Integers past every machine width (10**400 is past a double too)."""
WRONG = ["5", 5.5, True, None, [], {}, "NaN"]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]
"""Python's json writes these as the bare tokens NaN / Infinity, which lenient parsers take."""


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


class Raw(str):
    """A body field's JSON text, spliced in as is (Python's json cannot write 3,000 levels)."""


def nested_list(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


def encode(body: dict[str, Any]) -> bytes:
    """The body as JSON; NaN and Infinity as the bare tokens that lenient parsers take."""
    raws = {k: v for k, v in body.items() if isinstance(v, Raw)}
    text = json.dumps({k: (f"@{k}@" if k in raws else v) for k, v in body.items()})
    for k, v in raws.items():
        text = text.replace(f'"@{k}@"', v)
    return text.encode()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}

INT_FIELDS = ["max_tokens", "top_k", "n", "seed", "min_tokens"]
FLOAT_FIELDS = [
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
]  # fmt: skip


def _shared() -> list[tuple[str, dict[str, Any]]]:
    """Field overrides that apply to both routes."""
    cases: list[tuple[str, dict[str, Any]]] = []
    for f in INT_FIELDS:
        cases += [(f"{f}={v!r}", {f: v}) for v in [*BIG, *WRONG, *NON_FINITE, -(2**63)]]
    for f in FLOAT_FIELDS:
        cases += [
            (f"{f}={v!r}", {f: v}) for v in [*NON_FINITE, 1e308, -1e308, 2**70, "1", [], None]
        ]
    cases += [
        ("seed=max with n=2", {"seed": 2**63 - 1, "n": 2}),
        ("seed=2**64-1 with n=2", {"seed": 2**64 - 1, "n": 2}),
        ("n=100000", {"n": 100_000}),
        ("top_k=vocab+1", {"top_k": 10**6}),
        ("stop_token_ids big", {"stop_token_ids": [2**70]}),
        ("stop_token_ids 2**63", {"stop_token_ids": [2**63]}),
        ("stop_token_ids past vocab", {"stop_token_ids": [10**6]}),
        ("stop_token_ids negative", {"stop_token_ids": [-1]}),
        ("stop_token_ids strings", {"stop_token_ids": ["5"]}),
        ("stop_token_ids huge list", {"stop_token_ids": list(range(100_000))}),
        ("stop surrogate", {"stop": "\ud800"}),
        ("stop huge list", {"stop": ["x"] * 10_000}),
        ("stop huge string", {"stop": "x" * 100_000}),
        ("stop wrong type", {"stop": 5}),
        ("stop nested", {"stop": [["a"]]}),
        ("stream=5", {"stream": 5}),
        ("stream='yes'", {"stream": "yes"}),
        ("stream_options wrong", {"stream_options": "x"}),
        ("user surrogate", {"user": "\udfff"}),
        ("model surrogate", {"model": "\ud800"}),
        ("model huge", {"model": "m" * 100_000}),
        ("structured_outputs deep", {"structured_outputs": {"json": nested(300)}}),
        ("structured_outputs deep text", {"structured_outputs": {"json": _deep_text(300)}}),
        ("structured_outputs regex surrogate", {"structured_outputs": {"regex": "\ud800"}}),
        ("structured_outputs bad grammar", {"structured_outputs": {"grammar": "(((("}}),
        ("structured_outputs wrong", {"structured_outputs": [1]}),
        ("kv_transfer_params hostile", {"kv_transfer_params": {"do_remote_prefill": 2**70}}),
        ("cache_salt surrogate", {"cache_salt": "\ud800"}),
        ("cache_salt huge", {"cache_salt": "s" * 10_000}),
        ("cache_salt wrong", {"cache_salt": 5}),
    ]
    return cases


def _deep_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def chat_cases() -> list[tuple[str, dict[str, Any]]]:
    msg = [{"role": "user", "content": "hi"}]
    cases = [(name, {**CHAT, **over}) for name, over in _shared()]
    cases += [
        (f"chat {name}", {**CHAT, **over})
        for name, over in [
            ("content surrogate", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
            ("content low surrogate", {"messages": [{"role": "user", "content": "\udc00"}]}),
            ("content parts surrogate", {
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]
            }),
            ("content wrong type", {"messages": [{"role": "user", "content": 5}]}),
            ("content deep list", {"messages": nested_list(3000)}),
            ("messages empty", {"messages": []}),
            ("messages huge", {"messages": msg * 50_000}),
            ("messages wrong", {"messages": "hi"}),
            ("role wrong", {"messages": [{"role": "root", "content": "hi"}]}),
            ("name surrogate", {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}),
            ("logprobs=5", {"logprobs": 5}),
            ("top_logprobs big", {"logprobs": True, "top_logprobs": 2**70}),
            ("top_logprobs wrong", {"logprobs": True, "top_logprobs": "3"}),
            ("max_completion_tokens big", {"max_completion_tokens": 2**70}),
            ("max_completion_tokens str", {"max_completion_tokens": "5"}),
            ("response_format deep", {"response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": nested(300)}
            }}),
            ("response_format deep 60", {"response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": nested(60)}
            }}),
            ("response_format wrong", {"response_format": {"type": "xml"}}),
            ("response_format schema not object", {"response_format": {
                "type": "json_schema", "json_schema": {"schema": 5}
            }}),
            ("tools huge", {"tools": [_tool(f"f{i}") for i in range(5000)]}),
            ("tools deep", {"tools": [_tool("f", nested(300))]}),
            ("tools surrogate name", {"tools": [_tool("\ud800")]}),
            ("tools wrong", {"tools": [5]}),
            ("tool_choice unknown", {"tool_choice": {"type": "function", "function": {"name": "z"}}}),
            ("tool_choice wrong", {"tool_choice": 5}),
            ("chat_template_kwargs wrong", {"chat_template_kwargs": {"messages": 5}}),
            ("chat_template_kwargs deep", {"chat_template_kwargs": {"x": nested(300)}}),
            ("chat_template_kwargs tools", {"chat_template_kwargs": {"tools": "x"}}),
        ]
    ]  # fmt: skip
    return cases


def completion_cases() -> list[tuple[str, dict[str, Any]]]:
    cases = [(name, {**COMPLETION, **over}) for name, over in _shared()]
    cases += [
        (f"completion {name}", {**COMPLETION, **over})
        for name, over in [
            ("prompt surrogate", {"prompt": "\ud800"}),
            ("prompts surrogate", {"prompt": ["ok", "\udc00"]}),
            ("prompt ids big", {"prompt": [2**70]}),
            ("prompt ids 2**63", {"prompt": [2**63]}),
            ("prompt ids negative", {"prompt": [-1]}),
            ("prompt ids past vocab", {"prompt": [10**6]}),
            ("prompt ids mixed", {"prompt": [1, "a"]}),
            ("prompt ids floats", {"prompt": [1.5]}),
            ("prompt ids batch big", {"prompt": [[1], [2**70]]}),
            ("prompt many", {"prompt": ["a"] * 20_000, "n": 4}),
            ("prompt many ids", {"prompt": [[1]] * 5_000}),
            ("prompt empty list", {"prompt": []}),
            ("prompt empty string", {"prompt": ""}),
            ("prompt empty batch", {"prompt": [[]]}),
            ("prompt nested", {"prompt": nested_list(3000)}),
            ("prompt wrong", {"prompt": 5}),
            ("prompt huge text", {"prompt": "x " * 2_000_000}),
            ("logprobs big", {"logprobs": 2**70}),
            ("logprobs str", {"logprobs": "3"}),
            ("logprobs true", {"logprobs": True}),
            ("echo wrong", {"echo": "x"}),
            ("best_of big", {"best_of": 2**70}),
            ("suffix surrogate", {"suffix": "\ud800"}),
        ]
    ]
    return cases


MAY_SUCCEED = {
    *(f"{f}=None" for f in ("max_tokens", "top_k", "seed", "temperature", "top_p", "min_p")),
    "seed=2147483648", "seed=-9223372036854775808", "repetition_penalty=1e+308",
    "repetition_penalty=1180591620717411303424", "kv_transfer_params hostile",
}  # fmt: skip


def _tool(name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "parameters": params or {"type": "object"}},
    }
