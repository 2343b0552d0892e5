"""Azure LLM trace replay: 7-digit timestamps, lengths, seeded random prompts."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from ember.bench.workloads import load_azure_trace
from ember.bench.workloads.azure import parse_azure_timestamp
from ember.server.protocol import CompletionRequest

# The public traces the repository ships (benchmarks/data/traces/README.md); a missing trace fails
# the test, it does not skip.
TRACES = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "traces"
REAL_TRACE = TRACES / "azure_llm_2023_conv.csv"

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:16:01.0000001,5,1
2023-11-16 19:00:00.5,10,2
"""
# Seconds after the first row, by hand: 19:00:00 - 18:15:46 = 2654 s, then 0.5 - 0.68059.
SEND_AT = [0.0, 4.314579, 14.3194101, 2653.81941]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "azure.csv"
    path.write_text(CSV)
    return path


def test_parse_timestamp_keeps_all_seven_digits() -> None:
    second, fraction = parse_azure_timestamp("2023-11-16 18:15:46.6805900")
    assert second == datetime(2023, 11, 16, 18, 15, 46)
    assert fraction == pytest.approx(0.68059, abs=1e-12)
    assert parse_azure_timestamp("2023-11-16 18:16:01.0000001")[1] == pytest.approx(1e-7)
    assert parse_azure_timestamp("2023-11-16 18:16:01")[1] == 0.0
    with pytest.raises(ValueError):
        parse_azure_timestamp("2023-11-16 18:16:01.x")


def test_lengths_and_send_times(trace: Path) -> None:
    reqs = load_azure_trace(trace, model="m")
    assert [r.send_at for r in reqs] == pytest.approx(SEND_AT, abs=1e-9)
    assert [len(r.body["prompt"]) for r in reqs] == [374, 396, 5, 10]
    assert [r.body["max_tokens"] for r in reqs] == [44, 109, 1, 2]
    for r in reqs:
        assert r.path == "/v1/completions"
        assert r.body["ignore_eos"] is True
        assert all(10 <= t < 3000 for t in r.body["prompt"])
        assert r.ideal_cached_tokens is None
        CompletionRequest.model_validate(r.body)
    assert [r.request_id for r in reqs] == [f"azure-{i}" for i in range(4)]


def test_time_scale_max_requests_and_seed(trace: Path) -> None:
    doubled = load_azure_trace(trace, model="m", time_scale=2.0)
    assert [r.send_at for r in doubled] == pytest.approx([2 * t for t in SEND_AT], abs=1e-9)
    first = load_azure_trace(trace, model="m", max_requests=2)
    assert [r.body for r in first] == [r.body for r in doubled[:2]]
    again = load_azure_trace(trace, model="m", seed=0)
    other = load_azure_trace(trace, model="m", seed=1)
    assert [r.body["prompt"] for r in again] == [r.body["prompt"] for r in doubled]
    assert [r.body["prompt"] for r in other] != [r.body["prompt"] for r in doubled]
    narrow = load_azure_trace(trace, model="m", vocab=(100, 110))
    assert all(100 <= t < 110 for r in narrow for t in r.body["prompt"])


def test_bad_files_are_rejected(tmp_path: Path) -> None:
    no_columns = tmp_path / "x.csv"
    no_columns.write_text("time,tokens\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_azure_trace(no_columns, model="m")
    bad_row = tmp_path / "y.csv"
    bad_row.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(ValueError, match="y.csv:2"):
        load_azure_trace(bad_row, model="m")


def test_real_trace_loads() -> None:
    assert REAL_TRACE.is_file(), f"{REAL_TRACE} is missing"
    reqs = load_azure_trace(REAL_TRACE, model="m", max_requests=200)
    assert len(reqs) == 200
    assert reqs[0].send_at == 0.0 and reqs[1].send_at == pytest.approx(4.314579)
    times = [r.send_at for r in reqs]
    assert times == sorted(times)
