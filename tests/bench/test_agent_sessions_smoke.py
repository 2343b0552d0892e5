"""benchmarks/agent_sessions.py's `--device cpu` path: six sessions of the tiny model taking turns
over a 48-block pool and a 64-block host tier, served by ember with next-use and with LRU
eviction; the JSON holds the table's numbers, and next-use keeps hits where LRU keeps only the
shared system prompt's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_agent_sessions_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "agent_sessions.py"), "--device", "cpu",
        "--engines", "ember,ember-lru", "--sessions", "6", "--context", "300", "--new", "20",
        "--rounds", "4", "--pool-tokens", "768", "--host-gb", "0.00049",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [written] = tmp_path.glob("agent_sessions-cpu-*.json")
    report = json.loads(written.read_text())
    runs = {r["engine"]: r for r in report["runs"]}
    assert set(runs) == {"ember", "ember-lru"}
    for run in runs.values():
        assert run["sessions"] == 6 and run["start"] == "at-ready" and run["ready_s"] > 0
        assert run["first_turn_s"] > 0 and run["next_turn_s"] > 0
    # The shared system prompt (2 of ~19 blocks) hits either way; next-use keeps sessions too.
    assert runs["ember-lru"]["hit_ratio"] < 0.2
    assert runs["ember"]["hit_ratio"] > runs["ember-lru"]["hit_ratio"] + 0.2
    assert "| ember | 6 | at-ready |" in done.stdout
    assert runs["ember"]["host_tier_at_start"]["capacity_gib"] > 0  # whole before the load
