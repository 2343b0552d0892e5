"""The random workload: lengths in their ranges, Poisson arrivals, seeded streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.bench.workloads import random_workload
from ember.bench.workloads.arrivals import poisson_arrivals


def test_fixed_lengths_and_a_burst() -> None:
    reqs = random_workload(5, input_len=7, output_len=3, rate=None, model="m")
    assert [len(r.body["prompt"]) for r in reqs] == [7] * 5
    assert [r.body["max_tokens"] for r in reqs] == [3] * 5
    assert [r.send_at for r in reqs] == [0.0] * 5
    assert [r.request_id for r in reqs] == [f"random-{i}" for i in range(5)]
    assert all(r.body["ignore_eos"] is True and r.path == "/v1/completions" for r in reqs)
    assert reqs[0].body["prompt"] != reqs[1].body["prompt"]


@given(
    st.integers(1, 40),
    st.tuples(st.integers(1, 50), st.integers(0, 50)).map(lambda t: (t[0], t[0] + t[1])),
    st.tuples(st.integers(1, 50), st.integers(0, 50)).map(lambda t: (t[0], t[0] + t[1])),
    st.integers(0, 2**32),
)
def test_ranged_lengths_stay_in_range(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> None:
    reqs = random_workload(
        n, input_len=input_len, output_len=output_len, rate=None, seed=seed, model="m"
    )
    assert len(reqs) == n
    for r in reqs:
        assert input_len[0] <= len(r.body["prompt"]) <= input_len[1]
        assert output_len[0] <= r.body["max_tokens"] <= output_len[1]
        assert all(10 <= t < 3000 for t in r.body["prompt"])


def test_ranges_include_both_ends() -> None:
    reqs = random_workload(400, input_len=(1, 3), output_len=(5, 6), rate=None, model="m")
    assert {len(r.body["prompt"]) for r in reqs} == {1, 2, 3}
    assert {r.body["max_tokens"] for r in reqs} == {5, 6}


def test_poisson_gaps_have_the_rate_as_mean() -> None:
    rate = 4.0
    reqs = random_workload(20_000, input_len=1, output_len=1, rate=rate, seed=3, model="m")
    times = np.array([r.send_at for r in reqs])
    gaps = np.diff(times)
    assert times[0] == 0.0
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # exponential: std == mean
    assert np.median(gaps) == pytest.approx(np.log(2) / rate, rel=0.08)


def test_seeded_and_rate_does_not_change_prompts() -> None:
    def make(seed: int, rate: float | None) -> list:
        return random_workload(20, input_len=(1, 9), output_len=4, rate=rate, seed=seed, model="m")

    a, b, c = make(1, 2.0), make(1, 2.0), make(2, 2.0)
    assert [r.body for r in a] == [r.body for r in b]
    assert [r.send_at for r in a] == [r.send_at for r in b]
    assert [r.body for r in a] != [r.body for r in c]
    assert [r.body for r in make(1, None)] == [r.body for r in a]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        random_workload(3, input_len=(5, 2), output_len=1, rate=None, model="m")
    with pytest.raises(ValueError):
        random_workload(3, input_len=0, output_len=1, rate=None, model="m")
    with pytest.raises(ValueError):
        random_workload(3, input_len=1, output_len=1, rate=0.0, model="m")
    with pytest.raises(ValueError):
        random_workload(-1, input_len=1, output_len=1, rate=None, model="m")
    assert poisson_arrivals(0, 1.0, np.random.default_rng(0)) == []
    assert poisson_arrivals(1, 1.0, np.random.default_rng(0)) == [0.0]
