"""Token-id prompts for the open-loop workloads, and the `/v1/completions` request they send."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np

from ember.bench.records import PlannedRequest

DEFAULT_VOCAB: tuple[int, int] = (10, 3000)
"""Token ids are drawn from [lo, hi); this range is valid for ember's tiny models (vocab 3072).
Callers pass the served model's range, e.g. (10, vocab_size - 100) to stay clear of special ids."""

COMPLETIONS_PATH = "/v1/completions"


def check_vocab(vocab: tuple[int, int]) -> None:
    lo, hi = vocab
    if not 0 <= lo < hi:
        raise ValueError(f"vocab must be (lo, hi) with 0 <= lo < hi, got {vocab!r}")


@cache
def _token_objects(hi: int) -> np.ndarray:
    return np.arange(hi).astype(object)


def token_list(ids: np.ndarray, vocab: tuple[int, int]) -> list[int]:
    """Token ids as a list of Python ints, shared per id: a whole trace holds ~10^8 prompt tokens,
    and one int object per id keeps each at 8 bytes instead of 36."""
    return _token_objects(vocab[1])[ids].tolist()


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_token_ids(hash_ids: Sequence[int], block_size: int, vocab: tuple[int, int]) -> np.ndarray:
    """The token ids of a run of trace blocks, shape (len(hash_ids) * block_size,).

    Token j of block h is splitmix64(splitmix64(h) + j), a counter-based PRNG keyed by the hash id
    (the same in every process, unlike `hash()`), computed for all blocks at once.
    """
    check_vocab(vocab)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys = np.asarray(hash_ids, dtype=np.int64)
    if keys.size and keys.min() < 0:
        raise ValueError("hash ids are non-negative")
    seeds = _splitmix64(keys.astype(np.uint64))[:, None]
    positions = np.arange(block_size, dtype=np.uint64)[None, :]
    words = _splitmix64(seeds + positions).ravel()
    lo, hi = vocab
    return (words % np.uint64(hi - lo)).astype(np.int64) + lo


def block_tokens(
    hash_id: int, block_size: int = 512, vocab: tuple[int, int] = DEFAULT_VOCAB
) -> list[int]:
    """The token ids of one trace block: equal hash ids give equal blocks, different ones differ."""
    return token_list(block_token_ids([hash_id], block_size, vocab), vocab)


def random_tokens(rng: np.random.Generator, n: int, vocab: tuple[int, int]) -> list[int]:
    """`n` token ids drawn uniformly from [lo, hi)."""
    return token_list(rng.integers(vocab[0], vocab[1], size=n), vocab)


def completion_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    *,
    model: str,
    send_at: float | None,
    ideal_cached_tokens: int | None = None,
) -> PlannedRequest:
    """A `/v1/completions` request for a token-id prompt that always generates `max_tokens`."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    return PlannedRequest(
        request_id=request_id,
        path=COMPLETIONS_PATH,
        body=body,
        send_at=send_at,
        ideal_cached_tokens=ideal_cached_tokens,
    )


def check_replay_args(time_scale: float, max_requests: int | None) -> None:
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0 or None, got {max_requests}")


def fit_lengths(input_len: int, output_len: int, limit: int) -> tuple[int, int]:
    """(input, output) cut so that input + output <= limit: the output to at most half the
    context, the prompt to the rest (its start, so shared prefixes stay shared)."""
    if input_len + output_len <= limit:
        return input_len, output_len
    out = max(1, min(output_len, limit // 2))
    return max(1, min(input_len, limit - out)), out
