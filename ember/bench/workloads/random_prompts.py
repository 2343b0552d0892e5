"""The random workload: token-id prompts of fixed or uniformly drawn lengths, Poisson arrivals."""

from __future__ import annotations

import numpy as np

from ember.bench.records import PlannedRequest
from ember.bench.workloads.arrivals import poisson_arrivals
from ember.bench.workloads.prompts import (
    DEFAULT_VOCAB,
    check_vocab,
    completion_request,
    random_tokens,
)


def _lengths(
    rng: np.random.Generator, n: int, length: int | tuple[int, int], name: str
) -> list[int]:
    lo, hi = (length, length) if isinstance(length, int) else length
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must be n >= 1 or (lo, hi) with 1 <= lo <= hi, got {length!r}")
    return rng.integers(lo, hi, size=n, endpoint=True).tolist()


def random_workload(
    n: int,
    *,
    input_len: int | tuple[int, int],
    output_len: int | tuple[int, int],
    model: str,
    rate: float | None = None,
    seed: int = 0,
    vocab: tuple[int, int] = DEFAULT_VOCAB,
) -> list[PlannedRequest]:
    """`n` `/v1/completions` requests of random token ids.

    A length is a fixed int or a (lo, hi) range drawn uniformly, both ends included. Arrivals are
    Poisson at `rate` requests/s (the first at 0), or all at 0 when `rate` is None. Lengths, prompts
    and arrivals draw from separate streams of `seed`, so changing the rate keeps the prompts.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    check_vocab(vocab)
    lengths_rng, prompts_rng, arrivals_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    inputs = _lengths(lengths_rng, n, input_len, "input_len")
    outputs = _lengths(lengths_rng, n, output_len, "output_len")
    send_at = poisson_arrivals(n, rate, arrivals_rng)
    return [
        completion_request(
            f"random-{i}",
            random_tokens(prompts_rng, inputs[i], vocab),
            outputs[i],
            model=model,
            send_at=send_at[i],
        )
        for i in range(n)
    ]
