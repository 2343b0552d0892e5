from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.router.endpoint import (
    DECODE_REPORT_WEIGHT,
    KV_KNEE,
    KV_PRESSURE_TOKENS,
    Endpoint,
    LoadReport,
)


def report(
    *, prefill: int = 0, decode: int = 0, kv: float = 0.0, at: float = 0.0, running: int = 0
) -> LoadReport:
    return LoadReport(
        num_running=running,
        num_waiting=0,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        kv_usage=kv,
        at=at,
    )


def test_role_is_validated() -> None:
    for role in ("prefill", "decode", "both"):
        Endpoint("http://a", role)
    with pytest.raises(ValueError, match="role"):
        Endpoint("http://a", "mixed")


def test_fresh_endpoint_costs_nothing_but_the_request() -> None:
    ep = Endpoint("http://a", "both")
    assert ep.prefill_cost() == 0.0 and ep.decode_cost() == 0.0
    assert ep.prefill_cost(500) == 500.0
    assert ep.decode_cost(300) == 300.0


def test_add_and_remove_load_clamp_at_zero() -> None:
    ep = Endpoint("http://a", "both")
    ep.add_load(prefill_tokens=100, decode_tokens=40, requests=2)
    assert (ep.inflight_prefill_tokens, ep.active_decode_tokens, ep.active_requests) == (100, 40, 2)
    ep.remove_load(prefill_tokens=30, decode_tokens=100, requests=5)
    assert (ep.inflight_prefill_tokens, ep.active_decode_tokens, ep.active_requests) == (70, 0, 0)
    with pytest.raises(ValueError):
        ep.add_load(prefill_tokens=-1)
    with pytest.raises(ValueError):
        ep.remove_load(requests=-1)


def test_prefill_report_is_a_floor_not_folded_into_the_counter() -> None:
    ep = Endpoint("http://a", "prefill")
    ep.add_load(prefill_tokens=1000)
    ep.apply_report(report(prefill=400, at=1.0))  # the engine has not seen all of it yet
    assert ep.queued_prefill_tokens == 1000
    ep.apply_report(report(prefill=5000, at=2.0))  # traffic the router did not send
    assert ep.queued_prefill_tokens == 5000
    assert ep.inflight_prefill_tokens == 1000
    assert ep.prefill_cost(10) == 5010.0
    # Once the other traffic drains, the next report lets the cost fall back: no ratchet.
    ep.remove_load(prefill_tokens=1000)
    ep.apply_report(report(prefill=0, at=3.0))
    assert ep.queued_prefill_tokens == 0 and ep.prefill_cost() == 0.0


def test_decode_report_is_blended_into_the_counter() -> None:
    ep = Endpoint("http://a", "decode")
    ep.add_load(decode_tokens=1000)
    ep.apply_report(report(decode=2000, at=1.0))
    w = DECODE_REPORT_WEIGHT
    assert ep.active_decode_tokens == round((1 - w) * 1000 + w * 2000)


@given(
    start=st.integers(0, 1_000_000),
    truth=st.integers(0, 1_000_000),
)
def test_repeated_decode_reports_converge_on_the_engine(start: int, truth: int) -> None:
    ep = Endpoint("http://a", "decode", active_decode_tokens=start)
    for t in range(64):
        ep.apply_report(report(decode=truth, at=float(t)))
    assert abs(ep.active_decode_tokens - truth) <= 1


def test_a_late_answer_to_an_older_poll_is_ignored() -> None:
    ep = Endpoint("http://a", "both")
    ep.apply_report(report(prefill=10, decode=100, at=5.0))
    before = ep.active_decode_tokens
    ep.apply_report(report(prefill=999, decode=999_999, at=4.0))
    assert ep.reported is not None and ep.reported.at == 5.0
    assert ep.queued_prefill_tokens == 10 and ep.active_decode_tokens == before


def test_kv_pressure_is_zero_below_the_knee_and_full_at_full_usage() -> None:
    ep = Endpoint("http://a", "both")
    for kv in (0.0, 0.5, KV_KNEE):
        ep.apply_report(report(kv=kv))
        assert ep.kv_pressure() == 0.0
    ep.apply_report(report(kv=1.0))
    assert ep.kv_pressure() == pytest.approx(KV_PRESSURE_TOKENS)
    assert ep.decode_cost() == pytest.approx(KV_PRESSURE_TOKENS)
    ep.apply_report(report(kv=(1 + KV_KNEE) / 2))
    assert ep.kv_pressure() == pytest.approx(KV_PRESSURE_TOKENS / 2)


@given(a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0))
def test_kv_pressure_grows_with_usage(a: float, b: float) -> None:
    lo, hi = Endpoint("http://a", "both"), Endpoint("http://b", "both")
    lo.apply_report(report(kv=min(a, b)))
    hi.apply_report(report(kv=max(a, b)))
    assert 0.0 <= lo.kv_pressure() <= hi.kv_pressure() <= KV_PRESSURE_TOKENS


def test_load_report_parses_the_engines_load_json() -> None:
    body = {
        "ready": True,
        "running": 3,
        "waiting": 2,
        "in_flight": 5,
        "prefill_tokens": 1234,
        "decode_tokens": 5678,
        "kv_usage": 0.42,
        "free_blocks": 10,
        "total_blocks": 20,
    }
    r = LoadReport.from_load_json(body, at=7.5)
    assert r == LoadReport(3, 2, 1234, 5678, 0.42, 7.5)
    with pytest.raises(ValueError, match="malformed"):
        LoadReport.from_load_json({"running": 1}, at=0.0)
