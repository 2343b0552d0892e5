"""What a run measured, summed up: latency percentiles, throughput, goodput and cache hits."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ember.bench.records import RequestRecord

PERCENTILE_KEYS = ("mean", "p50", "p90", "p99")
ERROR_KIND_CHARS = 80
"""Error messages are grouped by their first 80 characters."""
INCOMPLETE = "incomplete: no error and no end time"
"""The error kind of a record that has neither an error nor an e2e (the run stopped first)."""


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of already sorted values, numpy's default "linear".

    With n values x[0] <= ... <= x[n-1], the rank is h = (n - 1) * q / 100 and the result
    interpolates linearly between the order statistics either side of it:
    x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]). Empty input gives NaN.
    """
    n = len(sorted_values)
    if n == 0:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    h = (n - 1) * q / 100.0
    lo = math.floor(h)
    if lo >= n - 1:
        return float(sorted_values[-1])
    frac = h - lo
    a, b = float(sorted_values[lo]), float(sorted_values[lo + 1])
    return a + frac * (b - a)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """{"mean", "p50", "p90", "p99"} of `values` (see `percentile` for the method).

    Empty input gives NaN for every key: the keys stay present and typed as floats, and a NaN
    cannot be mistaken for a measured 0. `ember.bench.report.write_json` stores NaN as null.
    """
    ordered = sorted(values)
    if not ordered:
        return dict.fromkeys(PERCENTILE_KEYS, math.nan)
    return {
        "mean": math.fsum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
    }


def _ms(values: list[float]) -> dict[str, float]:
    return percentiles([v * 1000.0 for v in values])


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def meets_slo(
    record: RequestRecord, *, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None
) -> bool:
    """Whether a record completed and met every SLO given (SLOs left None are not checked).

    A completed request with no first output chunk (ttft None) misses a TTFT SLO; one with fewer
    than two output tokens has no TPOT and so meets a TPOT SLO (no token after the first was late).
    """
    if not record.ok:
        return False
    if slo_ttft_s is not None and (record.ttft is None or record.ttft > slo_ttft_s):
        return False
    tpot = record.tpot
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> dict[str, Any]:
    """One run's summary; JSON-ready apart from NaNs (see `percentiles`).

    Latency stats (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms`: percentile dicts in milliseconds)
    and token counts cover completed requests only (`RequestRecord.ok`); failed ones are counted in
    `errors` and grouped in `error_kinds`. ITL pools every completed request's gaps. Throughputs
    divide by `duration_s`. `goodput` is completed requests meeting every given SLO per second
    (with no SLO, every completed request counts); `goodput_fraction` is their share of all
    requests sent. `cache_hit_ratio` is cached / prompt tokens of completed requests.

    Trace replay (records that carry `ideal_cached_tokens`) is judged over every request sent, so
    that failures cannot hide a cache's misses: `ideal_cache_hit_ratio` and `sent_cache_hit_ratio`
    (measured, a failed request counting as all misses) share the denominator, the prompt tokens
    sent; `completed_ideal_cache_hit_ratio` is the ideal over the completed ones, beside
    `cache_hit_ratio`. `trace_requests` and `trace_failed` count that set. All are None without
    ideal counts.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    error_kinds = Counter((r.error or INCOMPLETE)[:ERROR_KIND_CHARS] for r in failed)

    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [t for r in done if (t := r.tpot) is not None]
    itl = [gap for r in done for gap in r.itl]
    e2e = [r.e2e for r in done if r.e2e is not None]

    prompt = sum(r.prompt_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    good = sum(meets_slo(r, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s) for r in done)

    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(failed),
        "error_kinds": error_kinds,
        "duration_s": duration_s,
        "ttft_ms": _ms(ttft),
        "tpot_ms": _ms(tpot),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms(e2e),
        "request_throughput": len(done) / duration_s,
        "output_throughput": completion / duration_s,
        "input_throughput": prompt / duration_s,
        "slo_ttft_ms": None if slo_ttft_s is None else slo_ttft_s * 1000.0,
        "slo_tpot_ms": None if slo_tpot_s is None else slo_tpot_s * 1000.0,
        "good_requests": good,
        "goodput": good / duration_s,
        "goodput_fraction": _ratio(good, len(records)),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cache_hit_ratio": _ratio(cached, prompt),
        **_trace_hits(records),
        **_tokens_per_step(done),
    }


def _tokens_per_step(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """Speculative decoding per request, from the usage each answer reports: a request's output
    tokens over the forward steps that made them (each step makes one token of its own, the rest
    are accepted drafts), averaged over the requests that report it: the mean accepted length
    per request (1.0 without speculation)."""
    per_request = [
        r.completion_tokens / (r.completion_tokens - r.accepted_prediction_tokens)
        for r in done
        if r.accepted_prediction_tokens is not None
        and r.completion_tokens > r.accepted_prediction_tokens >= 0
    ]
    return {
        "mean_accepted_length_per_request": (
            sum(per_request) / len(per_request) if per_request else None
        ),
        "requests_with_accepted_length": len(per_request),
    }


def _sent_prompt(r: RequestRecord) -> int:
    return r.sent_prompt_tokens if r.sent_prompt_tokens is not None else r.prompt_tokens


def _trace_hits(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Measured and ideal prefix-cache hits over the same requests: all sent, and completed."""
    traced = [r for r in records if r.ideal_cached_tokens is not None]
    if not traced:
        return dict.fromkeys(
            ("ideal_cache_hit_ratio", "sent_cache_hit_ratio", "completed_ideal_cache_hit_ratio",
             "trace_requests", "trace_failed"),
        )  # fmt: skip
    done = [r for r in traced if r.ok]
    sent = sum(_sent_prompt(r) for r in traced)
    return {
        "ideal_cache_hit_ratio": _ratio(sum(r.ideal_cached_tokens or 0 for r in traced), sent),
        "sent_cache_hit_ratio": _ratio(sum(r.cached_tokens for r in done), sent),
        "completed_ideal_cache_hit_ratio": _ratio(
            sum(r.ideal_cached_tokens or 0 for r in done), sum(_sent_prompt(r) for r in done)
        ),
        "trace_requests": len(traced),
        "trace_failed": len(traced) - len(done),
    }
