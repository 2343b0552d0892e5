"""A tiktoken vocabulary (`tiktoken.model`: lines of `base64(token bytes) rank`), as Moonshot's Kimi
models ship theirs in place of a tokenizer.json, made into a byte-level `tokenizers` BPE.

The conversion is transformers' TikTokenConverter's (the tests check it against that and against
tiktoken's own encoding): the ranks become the ids, every split of a token into two tokens becomes
a merge ranked by the token it makes, and a piece the vocabulary holds whole is taken as it is
(`ignore_merges`), as tiktoken takes it. The file has no pre-tokenizer pattern: that is in the
model's Python tokenizer (tokenization_kimi.py), so Kimi's is written here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from ember.home import read_entry, write_entry
from ember.tokenizer.byte_level import bytes_to_unicode

TIKTOKEN_FILE = "tiktoken.model"

# Kimi's pat_str (tokenization_kimi.py): Han runs apart, words (letters other than Han, cased as
# camelCase splits them) with an English contraction, up to 3 digits, punctuation, whitespace.
# Oniguruma, the regex engine of `tokenizers`, reads the `&&` class intersections as tiktoken's
# Rust regex does, so the pattern runs unchanged.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """token bytes -> rank (its id), from a tiktoken file; the ranks must be 0..n-1."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path}:{n}: not `base64(token) rank`: {line[:80]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def tokenizer_from_tiktoken(
    path: str | Path,
    added_tokens_decoder: dict[str, dict[str, Any]],
    pattern: str = KIMI_PATTERN,
) -> Tokenizer:
    """The BPE of the tiktoken file at `path`, with the added tokens of tokenizer_config's
    `added_tokens_decoder` (id -> token) at their ids. Those ids follow the ranks; an id between
    them that names no token becomes `<|reserved_token_ID|>`, as tokenization_kimi.py names it."""
    ranks = read_tiktoken_ranks(path)
    spell = bytes_to_unicode()

    def spelled(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    bpe = models.BPE(
        {spelled(token): rank for token, rank in ranks.items()},
        [(spelled(left), spelled(right)) for *_, left, right in merges],
        fuse_unk=False,
        ignore_merges=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    added = _added_tokens(added_tokens_decoder, len(ranks), path)
    tokenizer.add_tokens(added)
    for i, token in enumerate(added, len(ranks)):
        # A content the vocabulary already spells would keep its rank instead.
        if tokenizer.token_to_id(token.content) != i:
            raise ValueError(f"added token {token.content!r} cannot have id {i} in {path}")
    return tokenizer


CONVERSION_VERSION = 1
"""Part of the cache key: bump it when tokenizer_from_tiktoken builds a different tokenizer."""


def cached_tokenizer_from_tiktoken(
    path: str | Path,
    added_tokens_decoder: dict[str, dict[str, Any]],
    pattern: str = KIMI_PATTERN,
) -> Tokenizer:
    """tokenizer_from_tiktoken, kept in ember's home (ember/home.py: ~/.cache/ember/tokenizers)
    as tokenizer.json text named by a hash of the file, the added tokens, the pattern and
    CONVERSION_VERSION: deriving the merges of Kimi's 163,840 tokens takes ~2 s, and a server
    loads its tokenizer in several processes; reading the cached JSON back takes a fraction."""
    data = Path(path).read_bytes()
    key = hashlib.sha256(data)
    key.update(
        json.dumps([added_tokens_decoder, pattern, CONVERSION_VERSION], sort_keys=True).encode()
    )
    name = f"tiktoken-{key.hexdigest()}.json"
    text = read_entry("tokenizers", name)
    if text is not None:
        try:
            return Tokenizer.from_str(text)
        except Exception:  # a torn or foreign file: derive it again and overwrite it
            pass
    tokenizer = tokenizer_from_tiktoken(path, added_tokens_decoder, pattern)
    write_entry("tokenizers", name, tokenizer.to_str())
    return tokenizer


def _added_tokens(decoder: dict[str, dict[str, Any]], first_id: int, path: Any) -> list[AddedToken]:
    """The added tokens in id order from `first_id` on (tokenizers gives them the next free ids)."""
    by_id = {int(i): entry for i, entry in decoder.items()}
    below = sorted(i for i in by_id if i < first_id)
    if below:
        raise ValueError(f"added token ids {below[:5]} fall among the {first_id} ranks of {path}")
    added = []
    for i in range(first_id, max(by_id, default=first_id - 1) + 1):
        entry = by_id.get(i, {"content": f"<|reserved_token_{i}|>", "special": True})
        added.append(
            AddedToken(
                entry["content"],
                single_word=entry.get("single_word", False),
                lstrip=entry.get("lstrip", False),
                rstrip=entry.get("rstrip", False),
                normalized=entry.get("normalized", False),
                special=entry.get("special", False),
            )
        )
    return added
