"""IncrementalDetokenizer: streamed text always adds up to decode() of the same ids."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.tokenizer.detokenizer import IncrementalDetokenizer
from ember.tokenizer.tokenizer import Tokenizer

MULTIBYTE = [
    "emoji 😀🎉 and a family 👨‍👩‍👧 with flags 🇯🇵🇧🇷",
    "中文测试，你好世界！日本語のテキスト、한국어 텍스트",
    "accents: café naïve résumé Ångström Øre ß",
    "mixed 🙂 é 中 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
    "code:\n    x = '✓'  # 完了\n",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir("qwen3"))


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids]
    return detok, pieces


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("prompt", [None, "Say something: ", "前文 😀"])
def test_pieces_add_up_to_decode(tok: Tokenizer, text: str, prompt: str | None) -> None:
    ids = tok.encode(text)
    prompt_ids = tok.encode(prompt) if prompt is not None else None
    detok, pieces = stream(tok, ids, prompt_ids)
    assert "".join(pieces) == detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert detok.flush() == ""


def test_partial_characters_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1, "the tiny vocabulary should split an emoji into byte tokens"
    _, pieces = stream(tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("<think>plan</think>ok <tool_call>{}</tool_call><|im_end|>")
    detok, pieces = stream(tok, ids, skip=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert "<tool_call>" in detok.text  # not special, so never skipped
    assert ("<|im_end|>" in detok.text) is not skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40), prompt=st.text(max_size=10))
def test_any_text(tok: Tokenizer, text: str, prompt: str) -> None:
    ids = tok.encode(text)
    detok, pieces = stream(tok, ids, tok.encode(prompt))
    assert "".join(pieces) == tok.decode(ids)
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in pieces)


def test_random_ids_never_fail_and_flush_completes(tok: Tokenizer) -> None:
    # A random model emits arbitrary bytes; the stream must cope, and after flush() the text is
    # exactly what decode() shows, replacement characters included.
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 30))]
        detok, pieces = stream(tok, ids, prompt)
        tail = detok.flush()
        assert "".join(pieces) + tail == detok.text == tok.decode(ids)
        assert detok.output_ids == ids
