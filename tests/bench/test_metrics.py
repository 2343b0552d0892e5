"""Percentiles against numpy, and a run's summary against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.bench.metrics import INCOMPLETE, meets_slo, percentile, percentiles, summarize
from ember.bench.records import RequestRecord

LONG_A = "x" * 80 + " first tail"
LONG_B = "x" * 80 + " second, different tail"


def hand_records() -> list[RequestRecord]:
    """Three completed requests and four failed ones; every expected value below is from these."""
    return [
        RequestRecord(  # ttft 100 ms, tpot (0.5 - 0.1) / 4 = 100 ms
            "r1",
            0.0,
            ttft=0.1,
            itl=[0.05, 0.1, 0.1, 0.15],
            e2e=0.5,
            prompt_tokens=100,
            completion_tokens=5,
            cached_tokens=50,
            ideal_cached_tokens=60,
        ),
        RequestRecord(  # ttft 200 ms, tpot (1.8 - 0.2) / 8 = 200 ms
            "r2",
            0.1,
            ttft=0.2,
            itl=[0.15, 0.25] + [0.2] * 6,
            e2e=1.8,
            prompt_tokens=200,
            completion_tokens=9,
            cached_tokens=0,
            ideal_cached_tokens=100,
        ),
        RequestRecord(  # ttft 300 ms, one token: no tpot, no gaps
            "r3",
            0.2,
            ttft=0.3,
            itl=[],
            e2e=0.3,
            prompt_tokens=50,
            completion_tokens=1,
            cached_tokens=50,
            ideal_cached_tokens=50,
        ),
        # Failed: their latencies and tokens must not reach the stats.
        RequestRecord(
            "e1",
            0.3,
            ttft=0.05,
            itl=[5.0],
            e2e=9.0,
            prompt_tokens=1000,
            completion_tokens=3,
            cached_tokens=1000,
            error="HTTP 500: boom",
        ),
        RequestRecord("e2", 0.4, ttft=0.01, itl=[7.0], prompt_tokens=10),  # never finished
        RequestRecord("e3", 0.5, error=LONG_A),
        RequestRecord("e4", 0.6, error=LONG_B),
    ]


@given(
    st.lists(
        st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=200,
    )
)
def test_percentiles_equal_numpy_linear(values: list[float]) -> None:
    got = percentiles(values)
    arr = np.asarray(values)
    want = {
        "mean": float(np.mean(arr)),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }
    scale = max(1.0, float(np.max(np.abs(arr))))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9 * scale), key


@given(
    st.lists(st.floats(min_value=0, max_value=1e3, allow_nan=False), min_size=1, max_size=50),
    st.floats(min_value=0, max_value=100),
)
def test_percentile_any_q_equals_numpy(values: list[float], q: float) -> None:
    want = float(np.percentile(np.asarray(values), q, method="linear"))
    assert percentile(sorted(values), q) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_percentiles_small_example() -> None:
    assert percentiles([4.0, 1.0, 3.0, 2.0]) == pytest.approx(
        {"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97}
    )
    assert percentiles([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}


def test_percentiles_of_nothing_are_nan() -> None:
    got = percentiles([])
    assert set(got) == {"mean", "p50", "p90", "p99"}
    assert all(math.isnan(v) for v in got.values())


def test_percentile_rejects_q_out_of_range() -> None:
    with pytest.raises(ValueError, match="percentile q"):
        percentile([1.0, 2.0], 101)


def test_summary_latencies_match_hand_values() -> None:
    s = summarize(hand_records(), 2.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 200, "p50": 200, "p90": 280, "p99": 298})
    assert s["tpot_ms"] == pytest.approx({"mean": 150, "p50": 150, "p90": 190, "p99": 199})
    # Pooled gaps (ms): 50 100 100 150 150 200 200 200 200 200 200 250; p99 rank 10.89.
    assert s["itl_ms"] == pytest.approx(
        {"mean": 2000 / 12, "p50": 200, "p90": 200, "p99": 200 + 0.89 * 50}
    )
    # E2E (ms): 300 500 1800; p90 rank 1.8, p99 rank 1.98.
    assert s["e2e_ms"] == pytest.approx(
        {"mean": 2600 / 3, "p50": 500, "p90": 500 + 0.8 * 1300, "p99": 500 + 0.98 * 1300}
    )


def test_summary_counts_errors_and_keeps_them_out_of_stats() -> None:
    s = summarize(hand_records(), 2.0)
    assert (s["requests"], s["completed"], s["errors"]) == (7, 3, 4)
    assert s["error_kinds"] == {"HTTP 500: boom": 1, INCOMPLETE: 1, "x" * 80: 2}
    assert s["duration_s"] == 2.0
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx((5 + 9 + 1) / 2)
    assert s["input_throughput"] == pytest.approx((100 + 200 + 50) / 2)
    assert (s["prompt_tokens"], s["completion_tokens"], s["cached_tokens"]) == (350, 15, 100)


def test_cache_hit_and_ideal_ratios_are_exact() -> None:
    s = summarize(hand_records(), 2.0)
    assert s["cache_hit_ratio"] == 100 / 350
    assert s["ideal_cache_hit_ratio"] == 210 / 350


def test_ideal_ratio_absent_without_ideal_counts() -> None:
    recs = [RequestRecord("a", 0.0, ttft=0.1, e2e=0.2, prompt_tokens=10, cached_tokens=4)]
    s = summarize(recs, 1.0)
    assert s["cache_hit_ratio"] == 0.4
    assert s["ideal_cache_hit_ratio"] is None


@pytest.mark.parametrize(
    ("slo_ttft_s", "slo_tpot_s", "good"),
    [
        (None, None, 3),  # no SLO: every completed request
        (0.25, 0.15, 1),  # r1 only: r2's TPOT and r3's TTFT are over
        (0.25, None, 2),  # r1, r2
        (None, 0.15, 2),  # r1, and r3 (one token, no TPOT to miss)
        (0.2, 0.2, 2),  # on the SLO counts as meeting it: r1, r2
        (0.01, None, 0),  # the failed e1 (ttft 50 ms) must not count
    ],
)
def test_goodput_counts_exactly_the_requests_meeting_every_slo(
    slo_ttft_s: float | None, slo_tpot_s: float | None, good: int
) -> None:
    s = summarize(hand_records(), 2.0, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    assert s["good_requests"] == good
    assert s["goodput"] == pytest.approx(good / 2.0)
    assert s["goodput_fraction"] == pytest.approx(good / 7)


def test_goodput_grid_only_the_fast_fast_corner_meets_both() -> None:
    recs = []
    for i, (ttft, tpot) in enumerate([(0.1, 0.01), (0.1, 0.05), (0.3, 0.01), (0.3, 0.05)]):
        recs.append(
            RequestRecord(f"g{i}", 0.0, ttft=ttft, e2e=ttft + 10 * tpot, completion_tokens=11)
        )
    assert [meets_slo(r, slo_ttft_s=0.2, slo_tpot_s=0.02) for r in recs] == [
        True,
        False,
        False,
        False,
    ]
    s = summarize(recs, 4.0, slo_ttft_s=0.2, slo_tpot_s=0.02)
    assert (s["good_requests"], s["goodput"], s["goodput_fraction"]) == (1, 0.25, 0.25)
    assert (s["slo_ttft_ms"], s["slo_tpot_ms"]) == (200.0, 20.0)


def test_summary_of_nothing() -> None:
    s = summarize([], 1.0)
    assert (s["requests"], s["completed"], s["errors"], s["request_throughput"]) == (0, 0, 0, 0.0)
    assert math.isnan(s["ttft_ms"]["p50"]) and math.isnan(s["cache_hit_ratio"])
    assert math.isnan(s["goodput_fraction"])


def test_summary_rejects_non_positive_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        summarize(hand_records(), 0.0)
