"""Open-loop arrival times: a Poisson process at a given rate, or everything at once."""

from __future__ import annotations

import numpy as np


def poisson_arrivals(n: int, rate: float | None, rng: np.random.Generator) -> list[float]:
    """`n` arrival times in seconds: the first at 0, then exponential gaps of mean 1/rate.

    `rate=None` sends all `n` at 0 (a burst). The first arrival is at 0 so a run starts loaded.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if rate is None:
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s or None, got {rate}")
    gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]
