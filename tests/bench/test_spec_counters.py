"""`ember bench`'s speculative decoding: the server's `spec_decode_*` counters parsed from fake
/metrics text (ember's and vLLM's spelling), differenced over a run, summed over engines, and
printed in the report, the sweep table, the compare table and the JSON."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ember.bench.compare import compare_table, load_result
from ember.bench.metrics import summarize
from ember.bench.records import RequestRecord
from ember.bench.report import markdown_table, sweep_table, write_json
from ember.bench.spec_counters import (
    MEAN_ACCEPTED,
    SpecCounters,
    SpecProbe,
    parse_spec_counters,
    spec_summary,
)
from ember.trust import INTERNAL_HEADER, SECRET_ENV


def ember_metrics(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    """/metrics as `ember serve` writes it (with another family around, as there is)."""
    lines = [
        "# HELP ember:num_requests_running Requests in the running batch.",
        "# TYPE ember:num_requests_running gauge",
        'ember:num_requests_running{model_name="m"} 3.0',
    ]
    for name, value in (
        ("num_drafts", drafts),
        ("num_draft_tokens", draft_tokens),
        ("num_accepted_tokens", accepted),
    ):
        lines += [
            f"# HELP ember:spec_decode_{name}_total x",
            f"# TYPE ember:spec_decode_{name}_total counter",
            f'ember:spec_decode_{name}_total{{model_name="m"}} {float(value)}',
        ]
    lines += [
        "# HELP ember:spec_decode_num_accepted_tokens_per_pos_total x",
        "# TYPE ember:spec_decode_num_accepted_tokens_per_pos_total counter",
    ]
    lines += [
        f'ember:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {v}'
        for i, v in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 5.0
"""


def test_parses_embers_counters() -> None:
    c = parse_spec_counters(ember_metrics(10, 40, 25, [9, 7, 5, 4]))
    assert c == SpecCounters(10, 40, 25, (9, 7, 5, 4))


def test_parses_vllms_counters_by_position_and_skips_created() -> None:
    assert parse_spec_counters(VLLM_METRICS) == SpecCounters(20, 60, 30, (15, 10, 5))


def test_the_servers_own_exposition_parses() -> None:
    """What ember.server.metrics writes, not only this file's idea of it."""
    from prometheus_client import generate_latest

    from ember.engine.messages import SchedulerStats
    from ember.server.metrics import ServerMetrics

    stats = SchedulerStats(
        spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=7, spec_accepted_per_pos=[3, 3, 1]
    )
    text = generate_latest(ServerMetrics("m", lambda: stats).registry).decode()
    assert parse_spec_counters(text) == SpecCounters(4, 12, 7, (3, 3, 1))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html><body>Not Found</body></html>",
        '# TYPE ember:num_requests_running gauge\nember:num_requests_running{model_name="m"} 1\n',
        '# TYPE ember_router_retries_total counter\nember_router_retries_total{leg="d"} 2\n',
    ],
)
def test_no_counters_is_none(text: str) -> None:
    assert parse_spec_counters(text) is None


def test_since_pads_positions_and_catches_a_restart() -> None:
    before = SpecCounters(10, 40, 20, ())  # no position counted yet
    after = SpecCounters(30, 100, 70, (15, 10))
    assert after.since(before) == SpecCounters(20, 60, 50, (15, 10))
    assert SpecCounters(5, 20, 10, (3,)).since(after) is None  # the server restarted


def test_summary_is_per_verification_step() -> None:
    s = spec_summary(SpecCounters(20, 80, 50, (16, 14, 12, 8)))
    assert s["drafts"] == 20 and s["draft_tokens"] == 80 and s["accepted_tokens"] == 50
    assert s[MEAN_ACCEPTED] == pytest.approx(1 + 50 / 20)
    assert s["acceptance_rate"] == pytest.approx(50 / 80)
    assert s["acceptance_rate_per_position"] == pytest.approx([0.8, 0.7, 0.6, 0.4])
    assert "not averaged per request" in s["scope"]
    none = spec_summary(SpecCounters())
    assert none["drafts"] == 0 and none[MEAN_ACCEPTED] is None and none["acceptance_rate"] is None
    assert none["acceptance_rate_per_position"] == []


# -- a fake server's /metrics ------------------------------------------------------------------


class FakeMetrics:
    """An HTTP server whose /metrics answers the next of `pages` (the last one again once they run
    out), or `status` with no body; records the headers of each call."""

    def __init__(self, pages: list[str], status: int = 200, secret: str | None = None) -> None:
        self.pages, self.status, self.secret = list(pages), status, secret
        self.calls: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.calls.append({k.lower(): v for k, v in self.headers.items()})
                status = fake.status
                if fake.secret and self.headers.get(INTERNAL_HEADER) != fake.secret:
                    status = 401
                body = b""
                if status == 200:
                    body = (fake.pages.pop(0) if len(fake.pages) > 1 else fake.pages[0]).encode()
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes() -> Iterator[list[FakeMetrics]]:
    made: list[FakeMetrics] = []
    yield made
    for f in made:
        f.stop()


def test_probe_differences_a_run_and_sums_engines(fakes: list[FakeMetrics]) -> None:
    a = FakeMetrics(
        [ember_metrics(10, 40, 20, [8, 6, 4, 2]), ember_metrics(30, 120, 70, [25, 20, 15, 10])]
    )
    b = FakeMetrics([VLLM_METRICS])  # nothing changes on this one over the run
    fakes += [a, b]
    probe = SpecProbe([a.url, b.url])
    probe.start()
    s = probe.finish()
    assert s is not None and s["drafts"] == 20 and s["accepted_tokens"] == 50
    assert s[MEAN_ACCEPTED] == pytest.approx(1 + 50 / 20)
    assert s["acceptance_rate_per_position"] == pytest.approx([17 / 20, 14 / 20, 11 / 20, 8 / 20])


def test_secret_is_sent_only_to_a_server_that_asks(
    fakes: list[FakeMetrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    open_ = FakeMetrics([ember_metrics(1, 4, 2, [1, 1])])
    guarded = FakeMetrics([ember_metrics(1, 4, 2, [1, 1])], secret="s3cret")
    fakes += [open_, guarded]
    for fake in (open_, guarded):
        probe = SpecProbe([fake.url])
        probe.start()
        assert probe.finish() is not None
    assert all(INTERNAL_HEADER not in h for h in open_.calls)
    assert [INTERNAL_HEADER in h for h in guarded.calls] == [False, True, False, True]


def test_a_refused_scrape_is_said_once_and_reports_nothing(
    fakes: list[FakeMetrics], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    guarded = FakeMetrics([ember_metrics(1, 4, 2, [1, 1])], secret="s3cret")
    fakes.append(guarded)
    probe = SpecProbe([guarded.url])
    for _ in range(2):
        probe.start()
        assert probe.finish() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "answered HTTP 401" in err[0] and SECRET_ENV in err[0]


def test_no_metrics_route_or_no_counters_report_nothing_quietly(
    fakes: list[FakeMetrics], capsys: pytest.CaptureFixture[str]
) -> None:
    missing = FakeMetrics([""], status=404)
    router = FakeMetrics(
        ['# TYPE ember_router_retries_total counter\nember_router_retries_total{leg="d"} 2\n']
    )
    fakes += [missing, router]
    for fake in (missing, router):
        probe = SpecProbe([fake.url])
        probe.start()
        assert probe.finish() is None
    assert capsys.readouterr().err == ""


def test_a_restart_during_the_run_reports_nothing(
    fakes: list[FakeMetrics], capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeMetrics([ember_metrics(30, 120, 70, [25]), ember_metrics(2, 8, 3, [2])])
    fakes.append(fake)
    probe = SpecProbe([fake.url])
    probe.start()
    assert probe.finish() is None
    assert "went back" in capsys.readouterr().err


# -- the report ----------------------------------------------------------------------------------


def summary_with(spec: dict | None) -> dict:
    recs = [RequestRecord("a", 0.0, ttft=0.1, itl=[0.01], e2e=0.11, completion_tokens=2)]
    return summarize(recs, 1.0) | {"speculative": spec}


SPEC = spec_summary(SpecCounters(20, 80, 50, (16, 14, 12, 8)))


def test_report_table_prints_the_mean_per_step_and_each_position() -> None:
    table = markdown_table(summary_with(SPEC))
    assert (
        "- speculative decoding: mean accepted length per verification step 3.50 "
        "(1 + accepted / drafts over 20 drafts, pooled over the run, not a per-request mean); "
        "50 of 80 draft tokens accepted (62.5%)"
    ) in table
    assert "- draft acceptance by position (share of drafts): 80.0%, 70.0%, 60.0%, 40.0%" in table
    none = markdown_table(summary_with(spec_summary(SpecCounters())))
    assert "- speculative decoding: no drafts verified during the run" in none
    assert "speculative" not in markdown_table(summary_with(None))


def test_json_sweep_and_compare_carry_it(tmp_path: Path) -> None:
    path = write_json(tmp_path / "on.json", config={}, records=[], summary=summary_with(SPEC))
    doc = json.loads(path.read_text())
    assert doc["summary"]["speculative"][MEAN_ACCEPTED] == pytest.approx(3.5)
    assert doc["summary"]["speculative"]["acceptance_rate_per_position"] == pytest.approx(
        [0.8, 0.7, 0.6, 0.4]
    )
    sweep = [
        {"rate": 1.0, "summary": summary_with(SPEC)},
        {"rate": 2.0, "summary": summary_with(None)},
    ]
    rows = sweep_table(sweep).splitlines()
    assert rows[0].endswith("| errors | accepted len/step |")
    assert rows[2].endswith("| 3.50 |") and rows[3].endswith("| - |")
    assert "accepted len" not in sweep_table([{"rate": 1.0, "summary": summary_with(None)}])
    off = write_json(tmp_path / "off.json", config={}, records=[], summary=summary_with(None))
    table = compare_table(load_result(off), load_result(path), ("off", "on"))
    assert "| mean accepted length per verification step | - | 3.50 | - |" in table
    assert "| draft acceptance rate | - | 0.625 | - |" in table
    plain = compare_table(load_result(off), load_result(off))
    assert "accepted" not in plain
