"""A `tokenizer.json` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

Two of llama.cpp's tokenizer models, each built the way transformers' GGUF tokenizer converter
builds it, so both encode text to the same ids:

- `gpt2`: byte-level BPE (Llama 3, Qwen2/3, SmolLM), with the file's merges.
- `llama`: SentencePiece BPE (Llama 2, Mistral, TinyLlama): "▁" for spaces, byte-fallback tokens
  `<0xNN>` for characters outside the vocabulary, and merges implied by the pieces' scores.

Where transformers and llama.cpp differ on a SentencePiece vocabulary, this follows transformers:
- Only the start of the text gets a "▁", and none if it starts with a space already: " hi" is
  "▁hi" (llama.cpp: "▁▁hi"), which decodes to "hi", one space short.
- Text after a special token gets no "▁": "<s>hi" is `<s>` "hi" (llama.cpp: `<s>` "▁hi").
The one place it follows the file instead: `tokenizer.ggml.add_space_prefix = false` turns the
"▁" prefix off, as in llama.cpp, where transformers ignores the key and always prepends.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ember.tokenizer.byte_level import bytes_to_unicode

# llama.cpp's token types (llama_token_type in llama.h).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space inside pieces
# `tokenizer.ggml.*` ids that transformers makes special tokens, whatever their token type.
_NAMED_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")

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


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The backend tokenizer that `meta` (the GGUF's `tokenizer.ggml.*` keys) describes."""
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece BPE)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    for key in _NAMED_IDS:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(
                f"GGUF tokenizer.ggml.{key} = {token_id} is outside the {len(tokens)}-token vocabulary"
            )
    tok, vocab = builders[kind](meta, tokens)
    _add_special_tokens(tok, meta, tokens, vocab, byte_level=kind == "gpt2")
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
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
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merge_pairs(merges),
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
    return tok, vocab


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    merges = meta.get("tokenizer.ggml.merges")
    scores = meta.get("tokenizer.ggml.scores")
    if merges:
        pairs = _merge_pairs(merges)
    elif scores is not None:
        pairs = merges_from_scores(tokens, list(scores))
    else:
        raise ValueError(
            "GGUF SentencePiece tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    # No unk_token, as in transformers: byte fallback covers every character the pieces miss.
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok, vocab


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every split of a piece into two pieces of the vocabulary is a merge ranked by the piece's
    score; ties go to the longer left part, then the longer right part, then vocabulary order.
    This is transformers' `generate_merges`, duplicates included: a repeated token keeps its
    first position in the order and its last id and score.
    """
    ids = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))
    ranked: list[tuple[str, str, float]] = []
    for piece, score in score_of.items():
        splits = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in ids and piece[k:] in ids
        ]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked.extend((left, right, score) for left, right in splits)
    # A stable sort, so equal keys keep the order above, as in transformers.
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """llama.cpp's "left right" merge strings as pairs."""
    return [(left, right) for left, _, right in (m.partition(" ") for m in merges)]


def _add_special_tokens(
    tok: Tokenizer,
    meta: dict[str, Any],
    tokens: list[str],
    vocab: dict[str, int],
    byte_level: bool,
) -> None:
    """Add the tokens that must be matched whole in the text, as transformers does.

    Control tokens and the named ones (bos, eos, unk, pad) are special; user-defined ones
    (`<think>`) are added but not special. In a byte-level vocabulary a control token spelled
    outside the byte alphabet is a llama.cpp mislabel and stays an ordinary vocabulary entry.
    """
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    alphabet = set(bytes_to_unicode().values())
    control = [
        t
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == TOKEN_CONTROL and (not byte_level or set(t) <= alphabet)
    ]
    named = [
        tokens[meta[f"tokenizer.ggml.{key}"]]
        for key in _NAMED_IDS
        if meta.get(f"tokenizer.ggml.{key}") is not None
    ]
    user = [
        t
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == TOKEN_USER_DEFINED and t in vocab
    ]
    # transformers' order: a named token that is also user-defined ends up special.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in named if t in vocab]
    )


def add_bos_token(meta: dict[str, Any]) -> bool:
    """Whether encoding starts with BOS: the file's flag, which defaults to on for SentencePiece.

    llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise, and so
    does transformers.
    """
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.TemplateProcessing:
    """BOS before and EOS after the text where the file asks for them (transformers' template)."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None and add_bos_token(meta) else None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    eos = tokens[eos_id] if eos_id is not None and add_eos else None

    def template(seq: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if bos else []
        parts.append(f"${seq}:{type_id}")
        return " ".join(parts + ([f"{eos}:{type_id}"] if eos else []))

    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(
        single=template("A", 0),
        pair=f"{template('A', 0)} {template('B', 1)}",
        special_tokens=list(dict.fromkeys(special)),
    )


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
    config["add_bos_token"] = add_bos_token(meta)
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
