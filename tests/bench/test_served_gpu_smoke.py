"""benchmarks/served_gpu.py's `--device cpu` path: ember served twice (a fresh start and a warm
one) on the tiny model, the same client and loads as on the GPU at toy sizes; the JSON holds every
number the issue's table is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_served_gpu_runs_ember_fresh_and_warm_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "served_gpu.py"), "--device", "cpu"]
    done = subprocess.run(
        [*cmd, "--engines", "ember"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "served_gpu-cpu.json").read_text())
    runs = report["engines"]["ember"]
    for kind in ("fresh", "warm"):
        run = runs[kind]
        assert run["ready_s"] > 0
        assert run["mixed"]["completed"] == 8 and run["mixed"]["errors"] == 0
        assert run["mixed"]["completion_tokens"] == 8 * 8  # ignore_eos: every token asked for
        assert run["b1_tpot_ms"] > 0
        assert [s["rate"] for s in run["sweep"]] == [4.0, 8.0]
    assert runs["first_minute"]["requests"] == 8 and runs["first_minute"]["worst"] > 0
    assert runs["warm_again"]["requests"] == 8 and runs["warm"]["mixed_again"]["completed"] == 8
    assert "| mixed, output tok/s |" in done.stdout
