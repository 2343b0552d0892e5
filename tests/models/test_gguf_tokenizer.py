"""SentencePiece GGUFs (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama) against
transformers' GGUF tokenizer.

A tiny Llama GGUF written here carries a trained SentencePiece-style vocabulary: `<unk> <s> </s>`,
byte-fallback tokens, "▁" pieces scored by merge order and no merges, so the merges come from the
scores. Encode, decode and the chat template must equal transformers' on the same file; the
model's logits too, which also covers llama's q/k row order in a file written here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers.tokenization_utils_base import generate_merges

from ember.models.gguf_tokenizer import SPACE, build_tokenizer, merges_from_scores
from ember.models.tiny import CHAT_TEMPLATE
from ember.tokenizer.tokenizer import Tokenizer
from tests.models.gguf_files import (
    SPM_ADDED,
    hf_tensors,
    sentencepiece_vocab,
    write_gguf,
)
from tests.models.gguf_oracle import (
    QUESTION,
    Imported,
    check_logits_every_step,
    check_tokenizer,
    mixed_lines,
)


@pytest.fixture(scope="module")
def llama_spm(tiny_model_dir, tmp_path_factory) -> Imported:
    """The tiny Llama checkpoint as a GGUF with a SentencePiece vocabulary of its vocab size."""
    hf_dir = tiny_model_dir("llama")
    cfg = json.loads((hf_dir / "config.json").read_text())
    vocab = sentencepiece_vocab(cfg["vocab_size"], chat_template=CHAT_TEMPLATE)
    root = tmp_path_factory.mktemp("llama-spm")
    tensors = hf_tensors(hf_dir, "llama")
    path = write_gguf(root / "tiny-llama-spm.gguf", "llama", cfg, vocab, tensors)
    return Imported(path, root / "imported")


def test_sentencepiece_tokenizer_matches_transformers(llama_spm: Imported) -> None:
    check_tokenizer(llama_spm.dir, llama_spm.hf_tok)


def test_sentencepiece_text_takes_every_path(llama_spm: Imported) -> None:
    """The text above meets BOS, "▁" pieces, byte fallback and the added tokens."""
    tok = Tokenizer.from_dir(llama_spm.dir)
    ids = tok.encode("\n".join(mixed_lines()))
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces[0] == "<s>" and pieces.count("<s>") == 2  # BOS, then the one in the text
    assert any(p.startswith(SPACE) and len(p) > 2 for p in pieces)
    assert {"<0xE6>", "<0xF0>"} <= set(pieces)  # CJK and emoji, outside the trained alphabet
    assert {t for t, _ in SPM_ADDED} | {"<unk>", "</s>"} <= set(pieces)


def test_sentencepiece_decode_round_trips(llama_spm: Imported) -> None:
    tok = Tokenizer.from_dir(llama_spm.dir)
    lines = mixed_lines()
    for line in lines + ["\n".join(lines)]:
        ids = tok.encode(line, add_special_tokens=False)
        # As in transformers: text that starts with a space gets no extra "▁", and the decoder
        # strips one leading space, so it comes back one space short.
        want = line[1:] if line.startswith(" ") else line
        assert tok.decode(ids, skip_special_tokens=False) == want, line[:60]


def test_sentencepiece_llama_logits_match_transformers_every_step(llama_spm: Imported) -> None:
    msgs = [{"role": "user", "content": QUESTION}]
    prompt = llama_spm.hf_tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    check_logits_every_step(llama_spm.dir, llama_spm.hf, list(prompt))


def test_merges_from_scores_match_transformers() -> None:
    vocab = sentencepiece_vocab(3072)
    assert vocab.scores is not None
    # Ties in score and a repeated token, which keeps its first place and its last id and score.
    tokens = vocab.tokens + ["ab", "a", "b", "abc", "bc", "c", "ab"]
    scores = vocab.scores + [-1.0, -5.0, -5.0, -1.0, -1.0, -5.0, -2.0]
    want = generate_merges(
        {t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores, strict=True))
    )
    got = merges_from_scores(tokens, scores)
    assert len(got) > len(vocab.tokens) // 2
    assert got == want


# ---------------------------------------------------------------- flags, from metadata alone


def spm_meta(**flags: Any) -> dict[str, Any]:
    """A minimal SentencePiece vocabulary: "▁hi" from "▁" + "hi", "hi" from "h" + "i"."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁hi", "hi", SPACE, "h", "i"]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 5,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    meta.update({f"tokenizer.ggml.{k}": v for k, v in flags.items()})
    return meta


def test_sentencepiece_adds_bos_unless_the_file_says_not_to() -> None:
    # llama.cpp and transformers both add BOS when a SentencePiece file has no add_bos_token.
    assert build_tokenizer(spm_meta()).encode("hi").tokens == ["<s>", "▁hi"]
    assert build_tokenizer(spm_meta(add_bos_token=False)).encode("hi").tokens == ["▁hi"]
    with_eos = build_tokenizer(spm_meta(add_eos_token=True))
    assert with_eos.encode("hi").tokens == ["<s>", "▁hi", "</s>"]


def test_sentencepiece_space_prefix_follows_the_file() -> None:
    """`add_space_prefix = false` turns the "▁" prefix off, as in llama.cpp; transformers' GGUF
    loader ignores the key and always prepends."""
    on = build_tokenizer(spm_meta(add_space_prefix=True))
    assert on.encode("hi", add_special_tokens=False).tokens == ["▁hi"]
    assert on.decode(on.encode(" hi").ids) == "hi"
    off = build_tokenizer(spm_meta(add_space_prefix=False))
    assert off.encode("hi", add_special_tokens=False).tokens == ["hi"]
    assert off.encode(" hi", add_special_tokens=False).tokens == ["▁hi"]
    assert off.decode(off.encode(" hi").ids, skip_special_tokens=True) == " hi"


def test_an_unsupported_tokenizer_model_is_named() -> None:
    with pytest.raises(ValueError, match="'t5' is not supported"):
        build_tokenizer(spm_meta(model="t5"))


def test_a_sentencepiece_file_without_scores_or_merges_is_refused() -> None:
    meta = spm_meta()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match="neither tokenizer.ggml.merges nor tokenizer.ggml.scores"):
        build_tokenizer(meta)


def test_a_special_token_id_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="bos_token_id = 9999 is outside the 264-token vocabulary"):
        build_tokenizer(spm_meta(bos_token_id=9999))
