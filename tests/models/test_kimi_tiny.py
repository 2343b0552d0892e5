"""The tiny kimi_k2 checkpoint: laid out as moonshotai/Kimi-K2-Instruct is (model_type kimi_k2 on
DeepseekV3ForCausalLM, a tiktoken.model and no tokenizer.json, Kimi's special tokens and chat
template); ember's logits equal transformers' DeepseekV3ForCausalLM on its weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ember import LLM, SamplingParams
from ember.models.tiny import DEEPSEEK
from ember.models.tiny_kimi import DEFAULT_SYSTEM_PROMPT
from ember.tokenizer.tokenizer import Tokenizer
from tests.capture import captured_logits
from tests.models.hf_reference import hf_greedy, hf_logits
from tests.models.test_vs_transformers import NEW_TOKENS, check_steps, random_prompt

SPECIAL_IDS = {
    "[BOS]": 3056,
    "[EOS]": 3057,
    "<|im_end|>": 3058,
    "<|im_user|>": 3059,
    "<|im_assistant|>": 3060,
    "<|im_system|>": 3062,
    "<|tool_calls_section_begin|>": 3063,
    "<|tool_calls_section_end|>": 3064,
    "<|tool_call_begin|>": 3065,
    "<|tool_call_argument_begin|>": 3066,
    "<|tool_call_end|>": 3067,
    "<|im_middle|>": 3069,
    "[UNK]": 3070,
    "[PAD]": 3071,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SYSTEM = f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"


@pytest.fixture(scope="module")
def kimi(tiny_model_dir) -> Path:
    return tiny_model_dir("kimi_k2")


@pytest.fixture(scope="module")
def tokenizer(kimi: Path) -> Tokenizer:
    return Tokenizer.from_dir(kimi)


def test_the_directory_is_laid_out_as_kimi_k2_instruct(kimi: Path, tokenizer: Tokenizer) -> None:
    assert not (kimi / "tokenizer.json").exists()
    assert (kimi / "tiktoken.model").is_file()
    config = json.loads((kimi / "config.json").read_text())
    assert config["model_type"] == "kimi_k2"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert {k: config[k] for k in DEEPSEEK} == DEEPSEEK
    assert config["vocab_size"] == tokenizer.vocab_size == 3072
    added = json.loads((kimi / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {e["content"]: int(i) for i, e in added.items()} == SPECIAL_IDS
    assert all(e["special"] for e in added.values())
    assert {t: tokenizer.token_to_id(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    # Ids tokenizer_config leaves out are named as tokenization_kimi.py names them.
    assert tokenizer.id_to_token(3061) == "<|reserved_token_3061|>"
    generation = json.loads((kimi / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [3058, 3057]  # <|im_end|> ends a chat turn
    assert config["eos_token_id"] == 3058
    assert tokenizer.eos_token_ids == {3058, 3057}
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id) == (3056, 3071)
    # No BOS is added (tiktoken adds none); special tokens in the text are matched as tokens.
    ids = tokenizer.encode("hi<|im_end|>")
    assert ids[-1] == 3058 and 3056 not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_logits_match_transformers_deepseek_v3(kimi: Path) -> None:
    # transformers knows no model_type kimi_k2 (the hub's config.json maps it to Moonshot's own
    # code); its DeepseekV3 classes read the same fields, and fuse the experts on load only under
    # their own model_type.
    raw = json.loads((kimi / "config.json").read_text())
    config = DeepseekV3Config.from_dict({**raw, "model_type": "deepseek_v3"})
    hf, info = DeepseekV3ForCausalLM.from_pretrained(
        kimi, config=config, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    llm = LLM(str(kimi), dtype="float32", block_size=4, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = llm.engine.tokenizer.encode("def tiny_model(x):\n    return x * 2  # 你好 don't")
    prompt += random_prompt(3, 20, config.vocab_size)
    with captured_logits(llm) as steps:
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)
    check_steps(steps, hf_logits(hf, prompt + tokens), len(prompt))


def test_chat_template_default_system_and_turns(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tokenizer.apply_chat_template(msgs, add_generation_prompt=False) == (
        SYSTEM + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
    )
    own = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    assert tokenizer.apply_chat_template(own) == (
        "<|im_system|>system<|im_middle|>Be terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_chat_template_tools_calls_and_results(tokenizer: Tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "functions.get_weather:1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
        {
            "role": "tool",
            "name": "get_weather",
            "tool_call_id": "functions.get_weather:1",
            "content": "Rain",
        },
    ]
    tools = json.dumps([WEATHER_TOOL], separators=(",", ":"))
    assert tokenizer.apply_chat_template(msgs, tools=[WEATHER_TOOL]) == (
        f"<|im_system|>tool_declare<|im_middle|>{tools}<|im_end|>"
        + SYSTEM
        + "<|im_user|>user<|im_middle|>Weather in Paris and Rome?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking."
        "<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
        "<|tool_call_end|>"
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}'
        "<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:1\nRain<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    # Each marker is one token of the prompt.
    ids = tokenizer.encode(tokenizer.apply_chat_template(msgs, tools=[WEATHER_TOOL]))
    assert ids.count(SPECIAL_IDS["<|tool_call_begin|>"]) == 2
    assert ids.count(SPECIAL_IDS["<|im_middle|>"]) == 7


def test_chat_template_names_a_call_without_an_id_by_its_index(tokenizer: Tokenizer) -> None:
    call = {"function": {"name": "get_weather", "arguments": {}}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call, call]}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    assert text.endswith(
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>"
    )
