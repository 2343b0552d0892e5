from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.router.cost import choose, request_cost
from ember.router.endpoint import Endpoint, LoadReport, NoEndpointError


def ep(url: str, *, prefill: int = 0, decode: int = 0, healthy: bool = True) -> Endpoint:
    return Endpoint(
        url, "both", healthy=healthy, inflight_prefill_tokens=prefill, active_decode_tokens=decode
    )


endpoint_loads = st.lists(
    st.tuples(st.integers(0, 50), st.integers(0, 50), st.booleans(), st.integers(0, 50)),
    min_size=1,
    max_size=8,
)


@given(loads=endpoint_loads, seed=st.integers(0, 2**32 - 1))
def test_the_least_cost_healthy_endpoint_is_always_chosen(
    loads: list[tuple[int, int, bool, int]], seed: int
) -> None:
    # Small token counts make exact ties common, so the tie path is exercised too.
    eps = [
        ep(f"http://e{i}", prefill=p, decode=d, healthy=h) for i, (p, d, h, _) in enumerate(loads)
    ]
    new = {e.url: n for e, (*_, n) in zip(eps, loads, strict=True)}
    healthy = [e for e in eps if e.healthy]
    if not healthy:
        with pytest.raises(NoEndpointError):
            choose(eps, new_prefill_tokens=new, rng=random.Random(seed))
        return
    got = choose(eps, new_prefill_tokens=new, rng=random.Random(seed))
    assert got.healthy
    assert request_cost(got, new[got.url]) == min(request_cost(e, new[e.url]) for e in healthy)


def test_ties_are_spread_over_every_tied_endpoint() -> None:
    eps = [ep("http://a", decode=10), ep("http://b", decode=10), ep("http://c", decode=10)]
    eps.append(ep("http://d", decode=11))  # one token more: never chosen
    rng = random.Random(0)
    picks = Counter(choose(eps, new_prefill_tokens=100, rng=rng).url for _ in range(3000))
    assert set(picks) == {"http://a", "http://b", "http://c"}
    assert all(800 < picks[u] < 1200 for u in picks), picks


def test_choice_is_reproducible_from_the_rng_seed() -> None:
    eps = [ep(f"http://e{i}") for i in range(5)]
    first = [choose(eps, new_prefill_tokens=1, rng=random.Random(s)).url for s in range(50)]
    again = [choose(eps, new_prefill_tokens=1, rng=random.Random(s)).url for s in range(50)]
    assert first == again


def test_a_prefix_cached_endpoint_wins_when_its_uncached_part_is_cheaper() -> None:
    cached, cold = ep("http://cached", decode=2000), ep("http://cold", decode=2000)
    # an 8k prompt: 7k of it cached on one endpoint
    new = {"http://cached": 1000, "http://cold": 8000}
    assert choose([cold, cached], new_prefill_tokens=new, rng=random.Random(0)) is cached


def test_a_prefix_cached_endpoint_loses_when_it_is_overloaded() -> None:
    cached, cold = ep("http://cached", prefill=20_000), ep("http://cold", prefill=1_000)
    new = {"http://cached": 1000, "http://cold": 8000}
    assert choose([cached, cold], new_prefill_tokens=new, rng=random.Random(0)) is cold


def test_the_engines_report_counts_in_the_choice() -> None:
    a, b = ep("http://a"), ep("http://b", prefill=500)
    # Traffic from elsewhere that only a's engine knows about.
    a.apply_report(LoadReport(4, 4, 3000, 0, 0.1, at=1.0))
    assert choose([a, b], new_prefill_tokens=100, rng=random.Random(0)) is b


def test_kv_pressure_steers_away_from_a_nearly_full_endpoint() -> None:
    full, roomy = ep("http://full", decode=1000), ep("http://roomy", decode=4000)
    full.apply_report(LoadReport(8, 0, 0, 1000, 0.99, at=1.0))
    roomy.apply_report(LoadReport(8, 0, 0, 4000, 0.5, at=1.0))
    assert choose([full, roomy], new_prefill_tokens=100, rng=random.Random(0)) is roomy


def test_decode_tokens_of_the_request_are_added() -> None:
    a = ep("http://a", decode=100)
    assert request_cost(a, 10, 50) == a.prefill_cost(10) + a.decode_cost(50) == 160.0


def test_unhealthy_endpoints_are_skipped_and_none_healthy_raises() -> None:
    sick, well = ep("http://sick", healthy=False), ep("http://well", decode=10**9)
    assert choose([sick, well], new_prefill_tokens=0, rng=random.Random(0)) is well
    with pytest.raises(NoEndpointError):
        choose([sick], new_prefill_tokens=0, rng=random.Random(0))
    with pytest.raises(NoEndpointError):
        choose([], new_prefill_tokens=0, rng=random.Random(0))


def test_a_missing_uncached_count_is_an_error() -> None:
    with pytest.raises(ValueError, match="http://b"):
        choose(
            [ep("http://a"), ep("http://b")],
            new_prefill_tokens={"http://a": 1},
            rng=random.Random(0),
        )
