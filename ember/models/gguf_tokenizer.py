"""A `tokenizer.json` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

Byte-level BPE vocabularies (llama.cpp's `gpt2` model: Llama 3, Qwen2/3, SmolLM) are built the
way transformers' GGUF tokenizer converter builds them, so both encode text to the same ids.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (llama_token_type in llama.h).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the split regex its merges were learned with. Any other value keeps
# GPT-2's own byte-level split (SmolLM2's "smollm" among them), as transformers does.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The backend tokenizer that `meta` (the GGUF's `tokenizer.ggml.*` keys) describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")

    alphabet = set(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # A token spelled outside the byte alphabet (llama.cpp writes some added tokens raw) is
        # respelled byte by byte, as transformers does.
        if not set(token) <= alphabet:
            token = "".join(bytes_to_unicode()[b] for b in token.encode("utf-8"))
        vocab[token] = index
    pairs = [tuple(m.split(" ", 1)) for m in merges]

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()

    # Control tokens are special; user-defined ones (`<think>`) are added but not special. Both
    # must be matched whole in the text. A control token spelled outside the byte alphabet is a
    # llama.cpp mislabel and stays an ordinary vocabulary entry.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind_ in zip(tokens, token_types, strict=False)
        if kind_ == TOKEN_CONTROL and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind_ in zip(tokens, token_types, strict=False)
        if kind_ == TOKEN_USER_DEFINED and t in vocab
    ]
    tok.add_special_tokens(control)
    tok.add_tokens(user)

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    bos = [(tokens[bos_id], bos_id)] if add_bos else []
    prefix = f"{tokens[bos_id]}:0 " if add_bos else ""
    tok.post_processor = processors.TemplateProcessing(
        single=f"{prefix}$A:0", pair=f"{prefix}$A:0 $B:1", special_tokens=bos
    )
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer_config.json`: the named special tokens and the add-BOS/EOS flags."""
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return config


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """Every id that ends a turn: EOS plus llama.cpp's end-of-turn / end-of-message ids."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return ids
