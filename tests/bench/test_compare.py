"""`ember bench compare`: two result files' summaries side by side, with the B/A ratio."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.bench.compare import compare_table, load_result
from ember.bench.metrics import summarize
from ember.bench.records import RequestRecord
from ember.bench.report import write_json


def run_file(path: Path, ttft_s: float, tpot_s: float, duration_s: float) -> Path:
    """Four completed requests of 11 output tokens and one failure, written as a result file."""
    recs = [
        RequestRecord(
            f"r{i}",
            0.0,
            ttft=ttft_s,
            itl=[tpot_s] * 10,
            e2e=ttft_s + 10 * tpot_s,
            prompt_tokens=100,
            completion_tokens=11,
            cached_tokens=50,
        )
        for i in range(4)
    ]
    recs.append(RequestRecord("bad", 0.0, error="HTTP 500: boom"))
    summary = summarize(recs, duration_s)
    return write_json(path, config={"ttft": ttft_s}, records=recs, summary=summary)


def row(table: str, label: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in\n{table}")


def test_compare_table_shows_both_values_and_the_ratio(tmp_path: Path) -> None:
    a = load_result(run_file(tmp_path / "colocated.json", 0.1, 0.1, 4.0))
    b = load_result(run_file(tmp_path / "pd.json", 0.2, 0.025, 2.0))
    table = compare_table(a, b, names=("colocated", "pd"))
    assert table.splitlines()[0] == "| metric | colocated | pd | pd/colocated |"
    assert row(table, "TPOT p90 (ms)") == ["100.00", "25.00", "0.25x"]
    assert row(table, "TTFT p50 (ms)") == ["100.00", "200.00", "2.00x"]
    assert row(table, "ITL mean (ms)") == ["100.00", "25.00", "0.25x"]
    assert row(table, "E2E p99 (ms)") == ["1100.00", "450.00", "0.41x"]
    assert row(table, "request throughput (req/s)") == ["1.00", "2.00", "2.00x"]
    assert row(table, "output throughput (tok/s)") == ["11.00", "22.00", "2.00x"]
    assert row(table, "requests") == ["5", "5", "1.00x"]
    assert row(table, "errors") == ["1", "1", "1.00x"]
    assert row(table, "cache hit ratio") == ["0.500", "0.500", "1.00x"]
    # Neither run carries ideal counts: shown as missing, no ratio.
    assert row(table, "ideal cache hit ratio") == ["-", "-", "-"]


def test_compare_table_no_ratio_against_zero(tmp_path: Path) -> None:
    a = load_result(run_file(tmp_path / "a.json", 0.1, 0.1, 1.0))
    b = load_result(run_file(tmp_path / "b.json", 0.1, 0.1, 1.0))
    a["summary"]["errors"] = 0
    assert row(compare_table(a, b), "errors") == ["0", "1", "-"]


def test_load_result_rejects_other_files(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="no 'summary'"):
        load_result(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(ValueError, match="not a JSON"):
        load_result(tmp_path / "y.json")
