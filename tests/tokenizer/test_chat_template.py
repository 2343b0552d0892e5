"""Chat template rendering against transformers' apply_chat_template(tokenize=False)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ember.tokenizer.chat_template import compile_chat_template, render_chat_template
from ember.tokenizer.tokenizer import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city. Returns <b>HTML</b> & text.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system_and_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 你好 😀"},
    ],
    "tool_calls_and_responses": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Rome, and the time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25}'},
        {
            "role": "assistant",
            "content": "Checking the time.",
            "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": {}}}],
        },
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "Paris 21, Rome 25, noon."},
    ],
    "reasoning_and_parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}],
        },
        {"role": "assistant", "content": "Answer.", "reasoning_content": "  think first  "},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "Other.", "thinking": "old field name"},
    ],
}


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    def load(arch: str):
        return Tokenizer.from_dir(tiny_model_dir(arch)), AutoTokenizer.from_pretrained(
            tiny_model_dir(arch)
        )

    return {arch: load(arch) for arch in ["llama", "qwen3"]}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL, TIME_TOOL]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(pair, arch, name, tools, add_generation_prompt) -> None:
    ours, hf = pair[arch]
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    got = ours.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert got == expected


def test_tokenized_prompt_matches_transformers(pair) -> None:
    ours, hf = pair["llama"]
    messages = CONVERSATIONS["tool_calls_and_responses"]
    expected = hf.apply_chat_template(
        messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    text = ours.apply_chat_template(messages, tools=[WEATHER_TOOL])
    # The template writes bos itself, so the prompt is tokenized without special tokens.
    assert ours.encode(text, add_special_tokens=False) == list(expected["input_ids"])
    assert text.startswith("<|endoftext|><|im_start|>system\n")


def test_template_shape(pair) -> None:
    ours, _ = pair["qwen3"]
    text = ours.apply_chat_template(CONVERSATIONS["tool_calls_and_responses"], tools=[WEATHER_TOOL])
    assert "<tools>\n" + '{"type": "function"' in text
    assert "Returns <b>HTML</b> & text." in text  # tojson must not HTML-escape
    assert "Zürich" in text  # nor escape non-ASCII
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>' in text
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_enable_thinking_kwarg(pair) -> None:
    ours, hf = pair["qwen3"]
    messages = CONVERSATIONS["user_only"]
    got = ours.apply_chat_template(messages, enable_thinking=False)
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert got == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def test_raise_exception_becomes_value_error(pair) -> None:
    ours, hf = pair["qwen3"]
    messages = [{"role": "banana", "content": "x"}]
    with pytest.raises(ValueError, match="^Unsupported message role: banana$"):
        ours.apply_chat_template(messages)
    with pytest.raises(Exception, match="Unsupported message role: banana"):
        hf.apply_chat_template(messages, tokenize=False)


def test_environment_features_match_transformers(pair) -> None:
    _, hf = pair["qwen3"]
    template = (
        "{%- set ns = namespace(n=0) -%}"
        "{%- for m in messages -%}{%- if loop.index > 2 %}{% break %}{% endif -%}"
        "{%- if m.role == 'system' %}{% continue %}{% endif -%}"
        "{%- set ns.n = ns.n + 1 -%}{{ m.role }}:{{ m.content | tojson(indent=2) }}\n"
        "{%- endfor %}\n"
        "  {% if true %}\n    lstrip{{ ns.n }}\n  {% endif %}\n"
        "{{ dict(a=1) | tojson }}{{ strftime_now('%Y') | length }}"
        "{% generation %}gen{% endgeneration %}{{ extra }}{{ eos_token }}"
    )
    messages = CONVERSATIONS["system_and_turns"]
    got = render_chat_template(template, messages, extra="X", eos_token="<|im_end|>")
    assert got == hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, extra="X"
    )


def test_templates_compile_once() -> None:
    assert compile_chat_template("{{ 1 }}") is compile_chat_template("{{ 1 }}")


def test_syntax_error_is_value_error() -> None:
    with pytest.raises(ValueError, match="invalid chat template"):
        compile_chat_template("{% if %}")


def test_empty_conversation_rejected() -> None:
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat_template("{{ messages }}", [])


def test_sandbox_blocks_python_internals() -> None:
    with pytest.raises(ValueError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user"}])
