"""`ember bench`'s mean accepted length per request: each answer's usage says how many of its
output tokens were accepted drafts; a request's tokens over its forward steps, averaged."""

from __future__ import annotations

from ember.bench.metrics import summarize
from ember.bench.records import RequestRecord
from ember.bench.report import markdown_table


def record(i: int, completion: int, accepted: int | None) -> RequestRecord:
    return RequestRecord(
        f"r{i}",
        0.0,
        ttft=0.01,
        e2e=0.1,
        completion_tokens=completion,
        accepted_prediction_tokens=accepted,
    )


def test_mean_accepted_length_per_request() -> None:
    records = [
        record(0, 40, 30),  # 40 tokens in 10 steps: 4.0
        record(1, 10, 0),  # nothing accepted: 1.0
        record(2, 12, None),  # the server reported nothing: not counted
    ]
    s = summarize(records, 1.0)
    assert s["mean_accepted_length_per_request"] == (4.0 + 1.0) / 2
    assert s["requests_with_accepted_length"] == 2
    assert "mean accepted length per request 2.5" in markdown_table(s)


def test_no_reports_no_line() -> None:
    s = summarize([record(0, 10, None)], 1.0)
    assert s["mean_accepted_length_per_request"] is None
    assert "per request" not in markdown_table(s)
