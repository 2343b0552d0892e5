"""benchmarks/load_weights.py's `--device cpu` path: every reader, warm and cold, takes every
byte of the checkpoint it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_load_weights_runs_every_reader_on_the_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "load_weights.py"), "--device", "cpu"]
    cmd += ["--threads", "1,3", "--chunks", "1"]
    done = subprocess.run(
        cmd, env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [written] = tmp_path.glob("load_weights-cpu-*.json")  # <bench>-<hardware>-<date>.json
    report = json.loads(written.read_text())
    rows = report["rows"]
    cases = {(r["reader"], r["threads"], r["chunk_mib"]) for r in rows}
    assert cases == {("library", 1, 0), ("staged", 1, 64), ("staged", 3, 64), ("staged", 8, 1)}
    assert {r["mode"] for r in rows} == {"warm", "cold"} and len(rows) == 8
    assert all(r["bytes"] == report["bytes"] > 0 for r in rows)
    assert "| cold | staged | 8 | 1 MiB |" in done.stdout
