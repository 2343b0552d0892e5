"""Cost-based choice of an endpoint for one request: least `prefill_cost + decode_cost` after
adding the request, ties broken at random. Never a round robin."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ember.router.endpoint import NoEndpointError

if TYPE_CHECKING:
    import random

    from ember.router.endpoint import Endpoint


def request_cost(
    endpoint: Endpoint, new_prefill_tokens: float, new_decode_tokens: int = 0
) -> float:
    """The endpoint's load, in tokens, once this request is added to it."""
    return endpoint.prefill_cost(new_prefill_tokens) + endpoint.decode_cost(new_decode_tokens)


def choose(
    endpoints: Iterable[Endpoint],
    *,
    new_prefill_tokens: Mapping[str, float] | float,
    rng: random.Random,
    new_decode_tokens: int = 0,
) -> Endpoint:
    """The healthy endpoint of least `request_cost`; exact ties are broken with `rng`.

    `new_prefill_tokens` is the request's uncached prompt tokens, per endpoint url when prefix
    caching makes them differ (every healthy url must be present), or one number for all; tokens
    an endpoint would load from a KV tier count at their weight (`endpoint.TIER_LOAD_WEIGHT`).
    `new_decode_tokens` is the context the request would decode there (0 for a prefill leg).
    """
    best: list[Endpoint] = []
    best_cost = float("inf")
    for ep in endpoints:
        if not ep.healthy:
            continue
        if isinstance(new_prefill_tokens, (int, float)):
            uncached = new_prefill_tokens
        else:
            try:
                uncached = new_prefill_tokens[ep.url]
            except KeyError:
                raise ValueError(f"new_prefill_tokens has no entry for {ep.url}") from None
        cost = request_cost(ep, uncached, new_decode_tokens)
        if cost < best_cost:
            best, best_cost = [ep], cost
        elif cost == best_cost:
            best.append(ep)
    if not best:
        raise NoEndpointError("no healthy endpoint")
    return best[0] if len(best) == 1 else rng.choice(best)
