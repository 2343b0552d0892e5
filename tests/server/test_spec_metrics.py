"""/metrics' speculative decoding: vLLM's `spec_decode_*` counters under `ember:`, read from the
engine's cumulative counters at scrape time, and the mean accepted length since start."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ember.engine.messages import SchedulerStats
from ember.server.metrics import ServerMetrics


def scrape(stats: SchedulerStats) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of what /metrics would answer for `stats`."""
    text = generate_latest(ServerMetrics("m", lambda: stats).registry).decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_counters_carry_the_engines_totals() -> None:
    stats = SchedulerStats(
        spec_drafts=10,
        spec_draft_tokens=40,
        spec_accepted_tokens=25,
        spec_accepted_per_pos=[9, 7, 5, 4],
    )
    got = scrape(stats)
    model = {"model_name": "m"}
    assert got["ember:spec_decode_num_drafts_total"] == [(model, 10)]
    assert got["ember:spec_decode_num_draft_tokens_total"] == [(model, 40)]
    assert got["ember:spec_decode_num_accepted_tokens_total"] == [(model, 25)]
    per_pos = got["ember:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos == [
        ({"model_name": "m", "position": str(i)}, v) for i, v in enumerate([9, 7, 5, 4])
    ]
    assert got["ember:spec_decode_mean_accepted_length"] == [(model, 1 + 25 / 10)]


def test_each_scrape_reads_the_counters_anew() -> None:
    stats = SchedulerStats(spec_drafts=2, spec_draft_tokens=8, spec_accepted_tokens=3)
    metrics = ServerMetrics("m", lambda: stats)

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m"})

    assert value("ember:spec_decode_num_accepted_tokens_total") == 3
    stats = SchedulerStats(spec_drafts=6, spec_draft_tokens=24, spec_accepted_tokens=15)
    assert value("ember:spec_decode_num_drafts_total") == 6
    assert value("ember:spec_decode_num_accepted_tokens_total") == 15
    assert value("ember:spec_decode_mean_accepted_length") == 1 + 15 / 6


def test_off_the_counters_are_zero_and_there_is_no_mean() -> None:
    got = scrape(SchedulerStats())
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert got[f"ember:spec_decode_{name}_total"] == [({"model_name": "m"}, 0)]
    assert "ember:spec_decode_num_accepted_tokens_per_pos_total" not in got  # no position yet
    assert "ember:spec_decode_mean_accepted_length" not in got  # 1 + 0 / 0 is not a length
    # The rest of /metrics is unchanged by speculative decoding's families.
    assert got["ember:num_requests_running"] == [({"model_name": "m"}, 0)]
