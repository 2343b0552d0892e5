"""The result file round-trips, the tables carry the summary's numbers, the plots are real PNGs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from ember.bench.metrics import summarize
from ember.bench.records import RequestRecord
from ember.bench.report import (
    format_number,
    markdown_table,
    plot_cdfs,
    plot_sweep,
    sweep_table,
    write_json,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records(ttft_s: float = 0.1, tpot_s: float = 0.02, n: int = 20) -> list[RequestRecord]:
    """n completed requests with spread latencies (10 output tokens each), and one failure."""
    out = []
    for i in range(n):
        ttft = ttft_s * (1 + i / n)
        tpot = tpot_s * (1 + i / (2 * n))
        out.append(
            RequestRecord(
                f"r{i}",
                i * 0.1,
                ttft=ttft,
                itl=[tpot] * 9,
                e2e=ttft + 9 * tpot,
                prompt_tokens=100,
                completion_tokens=10,
                cached_tokens=25 * (i % 3),
                ideal_cached_tokens=50,
            )
        )
    out.append(RequestRecord("bad", 2.0, error="HTTP 503: overloaded"))
    return out


def hand_summary() -> dict[str, Any]:
    """Two requests whose summary numbers are easy to spot in a table."""
    recs = [
        RequestRecord(
            "a",
            0.0,
            ttft=0.1,
            itl=[0.01, 0.03],
            e2e=0.14,
            prompt_tokens=300,
            completion_tokens=3,
            cached_tokens=100,
            ideal_cached_tokens=200,
        ),
        RequestRecord(
            "b",
            0.0,
            ttft=0.3,
            itl=[0.05, 0.07],
            e2e=0.42,
            prompt_tokens=100,
            completion_tokens=3,
            cached_tokens=0,
            ideal_cached_tokens=0,
        ),
        RequestRecord("c", 0.0, error="HTTP 500: boom"),
    ]
    return summarize(recs, 4.0, slo_ttft_s=0.2, slo_tpot_s=0.05)


def strict_json(path: Path) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_write_json_round_trips(tmp_path: Path) -> None:
    recs = records()
    summary = summarize(recs, 3.0, slo_ttft_s=0.15)
    config = {"workload": "random", "rate": 4.0, "url": "http://x"}
    path = write_json(tmp_path / "run" / "r.json", config=config, records=recs, summary=summary)
    doc = strict_json(path)
    assert doc["config"] == config
    assert doc["records"] == [dataclasses.asdict(r) for r in recs]
    assert doc["summary"] == summary  # every number, the error kinds and the percentile dicts
    assert doc["sweep"] is None


def test_write_json_stores_nan_and_inf_as_null(tmp_path: Path) -> None:
    recs = [RequestRecord("a", 0.0, ttft=0.1, e2e=0.1, completion_tokens=1)]  # no TPOT, no ITL
    summary = summarize(recs, 1.0)
    sweep = [{"rate": math.inf, "summary": summary, "records": recs}]
    path = write_json(tmp_path / "r.json", config={}, records=recs, summary=summary, sweep=sweep)
    doc = strict_json(path)
    assert doc["summary"]["tpot_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert doc["summary"]["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert doc["sweep"][0]["rate"] is None
    assert doc["sweep"][0]["records"] == [dataclasses.asdict(recs[0])]


def test_write_json_sweep_entries(tmp_path: Path) -> None:
    sweep = [
        {"rate": float(rate), "summary": summarize(records(0.05 * rate), 5.0)} for rate in (1, 2)
    ]
    path = write_json(
        tmp_path / "s.json", config={}, records=[], summary=sweep[-1]["summary"], sweep=sweep
    )
    doc = strict_json(path)
    assert [e["rate"] for e in doc["sweep"]] == [1.0, 2.0]
    assert [e["summary"] for e in doc["sweep"]] == [e["summary"] for e in sweep]


def test_markdown_table_has_the_numbers() -> None:
    table = markdown_table(hand_summary())
    # TTFT 100, 300 ms; TPOT 20, 60 ms; ITL 10 30 50 70 ms; E2E 140, 420 ms.
    assert "| TTFT | 200.00 | 200.00 | 280.00 | 298.00 |" in table
    assert "| TPOT | 40.00 | 40.00 | 56.00 | 59.60 |" in table
    assert "| ITL | 40.00 | 40.00 | 64.00 | 69.40 |" in table
    assert "| E2E | 280.00 | 280.00 | 392.00 | 417.20 |" in table
    assert "3 sent, 2 completed in 4.00 s" in table
    assert "0.50 req/s, 1.50 output tok/s, 100.00 input tok/s" in table
    # Only "a" meets TTFT <= 200 ms and TPOT <= 50 ms: 1 of 3 requests, 0.25 req/s.
    assert "goodput: 0.25 req/s, 1 requests (33.3%), SLO TTFT <= 200.0 ms, TPOT <= 50.0 ms" in table
    assert "- errors: 1 (1 x `HTTP 500: boom`)" in table
    # "c" carries no ideal count (not a trace request): the trace lines cover "a" and "b".
    assert "- cache hit over all 2 requests sent: 25.0% (ideal 50.0%); 0 failed" in table
    assert "- cache hit over the 2 completed: 25.0% (ideal 50.0%)" in table


def test_markdown_table_reads_a_loaded_summary_with_nulls(tmp_path: Path) -> None:
    recs = [RequestRecord("a", 0.0, ttft=0.1, e2e=0.1, completion_tokens=1, prompt_tokens=4)]
    path = write_json(tmp_path / "r.json", config={}, records=recs, summary=summarize(recs, 1.0))
    table = markdown_table(json.loads(path.read_text())["summary"])
    assert "| TPOT | - | - | - | - |" in table
    assert "| TTFT | 100.00 | 100.00 | 100.00 | 100.00 |" in table
    assert "- errors: 0\n" in table
    assert "ideal" not in table and "no SLO" in table


def test_sweep_table_one_row_per_rate() -> None:
    s = hand_summary()
    table = sweep_table([{"rate": 2.0, "summary": s}, {"rate": None, "summary": s}])
    lines = table.strip().splitlines()
    assert len(lines) == 4
    row = "| 0.50 | 1.50 | 200.00 | 280.00 | 40.00 | 56.00 | 25.0% | 1 |"
    assert lines[2] == "| 2.00 " + row
    assert lines[3] == "| inf " + row


def test_format_number_missing() -> None:
    assert format_number(None) == format_number(math.nan) == "-"
    assert format_number(1.005, 1) == "1.0"


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # axes, labels and curves; a blank canvas is far smaller


def test_plot_cdfs_writes_a_png(tmp_path: Path) -> None:
    assert_png(plot_cdfs(records(), tmp_path / "plots" / "cdf.png"))


def test_plot_cdfs_overlays_runs_and_survives_empty_panels(tmp_path: Path) -> None:
    runs = {"colocated": records(0.2, 0.1), "disaggregated": records(0.1, 0.025)}
    assert_png(plot_cdfs(runs, tmp_path / "both.png"))
    assert_png(plot_cdfs([RequestRecord("x", 0.0, error="boom")], tmp_path / "empty.png"))


def sweep_of(ttft_s: float, tpot_s: float) -> list[dict[str, Any]]:
    return [
        {"rate": float(rate), "summary": summarize(records(ttft_s * rate, tpot_s * rate), 5.0)}
        for rate in (1, 2, 4, 8)
    ]


def test_plot_sweep_writes_a_png(tmp_path: Path) -> None:
    assert_png(plot_sweep(sweep_of(0.05, 0.01), tmp_path / "sweep.png"))


def test_plot_sweep_compares_labelled_runs(tmp_path: Path) -> None:
    runs = {"colocated": sweep_of(0.05, 0.0125), "disaggregated": sweep_of(0.08, 0.003)}
    runs["colocated"].append({"rate": math.inf, "summary": runs["colocated"][0]["summary"]})
    assert_png(plot_sweep(runs, tmp_path / "compare.png"))


def test_ecdf_thins_long_runs_but_keeps_both_ends() -> None:
    from ember.bench.report import _ecdf

    xs, ys = _ecdf([float(v) for v in range(10_000, 0, -1)], max_points=100)
    assert (xs[0], ys[0]) == (1.0, 0.0)
    assert (xs[-1], ys[-1]) == (10_000.0, 1.0)
    assert len(xs) <= 102 and xs == sorted(xs) and ys == sorted(ys)
    assert _ecdf([]) == ([], [])
