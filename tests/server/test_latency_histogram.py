"""ember's latency histogram against prometheus_client's own Histogram: the same observations give
the same exposition lines (buckets, count, sum), including values on a bucket's bound, below the
first and above the last, and observations taken n at a time."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ember.server.metrics import _LATENCY_BUCKETS, LatencyHistogram


def _samples(text: str) -> dict[str, float]:
    """Sample lines (no comments, no `_created`) by name and labels."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_exposition_equals_prometheus_clients_histogram() -> None:
    ours_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    ours = LatencyHistogram("ember:x_seconds", "doc", "m", _LATENCY_BUCKETS, ours_reg)
    ref = Histogram(
        "ember:x_seconds", "doc", ["model_name"], buckets=_LATENCY_BUCKETS, registry=ref_reg
    ).labels("m")
    rng = random.Random(0)
    values = [rng.expovariate(20.0) for _ in range(2000)]
    values += [0.0, 0.001, 0.005, 0.25, 160.0, 160.5, 1e9]  # bounds, below the first, past the last
    for v in values:
        ours.observe(v)
        ref.observe(v)
    for v, n in ((0.03, 5), (2.5, 3), (500.0, 2)):  # a step's n tokens share one gap
        ours.observe(v, n)
        for _ in range(n):
            ref.observe(v)
    got, want = (
        _samples(generate_latest(ours_reg).decode()),
        _samples(generate_latest(ref_reg).decode()),
    )
    assert got.keys() == want.keys() and len(got) == len(_LATENCY_BUCKETS) + 3
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key
    assert got['ember:x_seconds_count{model_name="m"}'] == len(values) + 10


def test_an_empty_histogram_exposes_zeros() -> None:
    reg = CollectorRegistry()
    LatencyHistogram("ember:y_seconds", "doc", "m", (0.1, 1.0), reg)
    got = _samples(generate_latest(reg).decode())
    assert got == {
        'ember:y_seconds_bucket{le="0.1",model_name="m"}': 0.0,
        'ember:y_seconds_bucket{le="1.0",model_name="m"}': 0.0,
        'ember:y_seconds_bucket{le="+Inf",model_name="m"}': 0.0,
        'ember:y_seconds_count{model_name="m"}': 0.0,
        'ember:y_seconds_sum{model_name="m"}': 0.0,
    }
