"""`ember bench` against a real `ember serve` (tiny model, CPU) reads its speculative decoding
counters through the cluster secret and reports them, or says once why it cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember.trust import SECRET_ENV
from tests.servers import SECRET, Server, start_server

K = 3


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[Server]:
    s = start_server(
        tiny_model_dir("llama"), "--speculative", "ngram", "--num-speculative-tokens", str(K)
    )
    yield s
    s.stop()


def bench(
    url: str, out: Path, secret: str | None, output_len: int = 8
) -> subprocess.CompletedProcess[str]:
    """A random run (greedy, seeded token prompts) of 4 requests."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if secret:
        env[SECRET_ENV] = secret
    cmd = [
        sys.executable, "-m", "ember.cli", "bench", "--url", url, "--workload", "random",
        "--num-requests", "4", "--input-len", "32", "--output-len", str(output_len),
        "--out", str(out), "--name", "run", "--no-progress",
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_without_the_secret_it_says_why_once(server: Server, tmp_path: Path) -> None:
    r = bench(server.url, tmp_path, None)
    assert r.returncode == 0, r.stderr
    said = [
        line for line in r.stderr.splitlines() if "speculative decoding is not reported" in line
    ]
    assert len(said) == 1 and "HTTP 401" in said[0] and SECRET_ENV in said[0]
    summary = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert summary["speculative"] is None and summary["kv_tiers"] is None
    assert "per verification step" not in r.stdout
    # Each answer's usage still says what speculation did for it, secret or not.
    assert summary["requests_with_accepted_length"] == 4
    assert "mean accepted length per request" in r.stdout


def test_the_run_reports_the_servers_drafts(server: Server, tmp_path: Path) -> None:
    """Greedy requests on the tiny model repeat themselves enough for n-gram drafts; what is
    checked is that the report is the counters' (consistent with itself), not a speed-up."""
    r = bench(server.url, tmp_path, SECRET, output_len=48)
    assert r.returncode == 0, r.stderr
    assert "speculative decoding is not reported" not in r.stderr
    summary = json.loads((tmp_path / "run.json").read_text())["summary"]
    # The same scrape's prefix-cache counters: the run's prompts, looked up once each.
    tiers = summary["kv_tiers"]
    assert tiers["prefix_queries"] >= 4 * 32 and 0 <= tiers["prefix_hit_ratio"] <= 1
    assert "server-counted prefix cache hit" in r.stdout
    spec = summary["speculative"]
    assert spec["drafts"] > 0 and 0 < spec["draft_tokens"] <= K * spec["drafts"]
    mean = spec["mean_accepted_length_per_step"]
    assert mean == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])
    assert 1 <= mean <= 1 + K
    per_pos = spec["acceptance_rate_per_position"]
    assert len(per_pos) <= K and all(0 <= x <= 1 for x in per_pos)
    assert sum(per_pos) * spec["drafts"] == pytest.approx(spec["accepted_tokens"])
    assert f"mean accepted length per verification step {mean:.2f}" in r.stdout
