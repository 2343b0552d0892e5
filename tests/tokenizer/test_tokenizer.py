"""Tokenizer against transformers' AutoTokenizer on the tiny checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ember.tokenizer.tokenizer import Tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces  ",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n\n\tindented\r\n",
    'json = {"key": [1, 2.5, null], "ok": true}',
    "emoji 😀🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "中文测试，你好世界！日本語のテキスト",
    "café naïve résumé Ångström; decomposed: cafe\u0301",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    'call <tool_call>{"name": "f"}</tool_call> then <think>hmm</think>',
    "almost special: <|im_start <tool_call",
    "numbers 1234567890 3.14159 -42 1e-6",
]


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir) -> dict[str, tuple[Tokenizer, object]]:
    return {
        arch: (
            Tokenizer.from_dir(tiny_model_dir(arch)),
            AutoTokenizer.from_pretrained(tiny_model_dir(arch)),
        )
        for arch in ARCHS
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizers, arch: str, text: str) -> None:
    ours, hf = tokenizers[arch]
    assert ours.encode(text) == hf(text)["input_ids"]
    assert (
        ours.encode(text, add_special_tokens=False)
        == hf(text, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tokenizers, arch: str, skip: bool) -> None:
    ours, hf = tokenizers[arch]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )


def test_bos_only_where_the_post_processor_adds_it(tokenizers) -> None:
    llama, _ = tokenizers["llama"]
    qwen, _ = tokenizers["qwen3"]
    bos = llama.token_to_id("<|endoftext|>")
    assert llama.bos_token_id == bos
    assert llama.encode("hi")[0] == bos
    assert llama.encode("hi", add_special_tokens=False)[0] != bos
    assert qwen.bos_token_id is None
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_special_ids_match_transformers(tokenizers, arch: str) -> None:
    ours, hf = tokenizers[arch]
    im_end, eot = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert ours.vocab_size == len(hf)
    assert ours.eos_token_ids == frozenset({im_end, eot})
    assert ours.pad_token_id == hf.pad_token_id == eot
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.all_special_ids == frozenset(hf.all_special_ids)
    # Tool and think markers are added tokens but not special: they survive skip_special_tokens.
    assert ours.token_to_id("<tool_call>") not in ours.all_special_ids


def test_token_id_round_trip(tokenizers) -> None:
    ours, _ = tokenizers["qwen3"]
    for token in ["<|im_start|>", "<think>", "Ġreturn"]:
        token_id = ours.token_to_id(token)
        assert token_id is not None
        assert ours.id_to_token(token_id) == token
    assert ours.token_to_id("definitely not a token") is None


def test_chat_template_is_read(tokenizers) -> None:
    ours, hf = tokenizers["qwen3"]
    assert ours.chat_template == hf.chat_template
    assert "<tool_call>" in ours.chat_template


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _copy_with_configs(src: Path, dst: Path, config: dict, generation: dict | None) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


def test_no_chat_template_raises(tiny_model_dir, tmp_path: Path) -> None:
    path = _copy_with_configs(
        tiny_model_dir("qwen3"), tmp_path / "m", {"eos_token": "<|im_end|>"}, None
    )
    tok = Tokenizer.from_dir(path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_from_generation_config_int_and_added_token_dicts(
    tiny_model_dir, tmp_path: Path
) -> None:
    config = {
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "chat_template": "{{ eos_token }}|{{ pad_token }}|{{ image_token }}",
        "image_token": "<think>",
    }
    path = _copy_with_configs(tiny_model_dir("qwen3"), tmp_path / "m", config, {"eos_token_id": 5})
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_ids == frozenset({5, tok.token_to_id("<|im_end|>")})
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_end|>|<|endoftext|>|<think>"
    )


def test_chat_template_jinja_file_wins(tiny_model_dir, tmp_path: Path) -> None:
    path = _copy_with_configs(
        tiny_model_dir("qwen3"), tmp_path / "m", {"chat_template": "config"}, None
    )
    (path / "chat_template.jinja").write_text("file")
    assert Tokenizer.from_dir(path).chat_template == "file"


def test_tool_use_template_is_chosen_with_tools(tiny_model_dir, tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools"},
        ]
    }
    tok = Tokenizer.from_dir(
        _copy_with_configs(tiny_model_dir("qwen3"), tmp_path / "m", config, None)
    )
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "plain"
    assert tok.apply_chat_template(messages, tools=[{"type": "function"}]) == "tools"
