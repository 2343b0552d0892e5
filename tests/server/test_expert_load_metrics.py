"""/metrics' expert load: one counter sample a rank of an expert-parallel engine, none otherwise."""

from __future__ import annotations

from ember.engine.messages import SchedulerStats
from tests.server.test_spec_metrics import scrape


def test_one_sample_a_rank() -> None:
    got = scrape(SchedulerStats(expert_load=[120, 80]))["ember:expert_load_tokens_total"]
    assert got == [
        ({"model_name": "m", "rank": "0"}, 120),
        ({"model_name": "m", "rank": "1"}, 80),
    ]


def test_absent_without_expert_parallel() -> None:
    assert "ember:expert_load_tokens_total" not in scrape(SchedulerStats())
