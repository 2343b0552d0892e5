"""benchmarks/step_log.py on a real engine core's step log: two bursts of requests (the second
after a pause) come out as two bursts with their requests, submissions and phases."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_log  # noqa: E402


@pytest.fixture
def log_file(tmp_path: Path):
    path = tmp_path / "steps.log"
    handler = logging.FileHandler(path)
    logger = logging.getLogger("ember.engine.steps")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield path
    logger.removeHandler(handler)
    logger.setLevel(level)
    handler.close()


def _burst(core: EngineCore, tag: str, sizes: list[int]) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    now = time.monotonic()
    for i, n in enumerate(sizes):
        submitted = now - 0.001 * (len(sizes) - 1 - i)  # 1 ms apart, the last now
        req = EngineCoreRequest(f"{tag}{i}", list(range(3, 3 + n)), params, [], 3)
        req.arrival_time = submitted
        core.add_request(req)
    while core.has_unfinished_requests():
        core.step()


def test_two_bursts_with_their_arrivals_and_phases(tiny_model_dir, log_file: Path, monkeypatch):
    monkeypatch.setattr(step_log, "FULL_STEP_TOKENS", 16)  # the tiny model's "full" step
    config = EngineConfig(
        model=str(tiny_model_dir("llama")), max_model_len=256, num_kv_blocks=64, cpu_threads=1
    )
    core = EngineCore(config)
    try:
        _burst(core, "a", [20, 9, 30])
        time.sleep(0.3)
        _burst(core, "b", [12])
    finally:
        core.close()
    found = [
        step_log.summarize(b) for b in step_log.bursts(step_log.parse(log_file.read_text()), 0.2)
    ]
    assert [b["requests"] for b in found] == [3, 1]
    first = found[0]
    (lump,) = first["arrivals"]  # all three seen by the first step
    assert lump["requests"] == 3 and lump["submitted_ms"][0] == 0.0
    assert lump["submitted_ms"][1] == pytest.approx(2.0, abs=0.15)  # the third 2 ms after the first
    assert lump["submitted_ms"][1] <= lump["received_ms"][0] <= lump["received_ms"][1]
    assert lump["received_ms"][1] <= lump["seen_ms"] and lump["launch_ms"] > 0
    assert "received" in step_log.arrival(lump) and "launch" in step_log.arrival(lump)
    # One prefill step (59 tokens) then two decode steps of three rows (3 tokens asked each).
    assert first["prefill_steps"] == 1 and first["decode_steps"] == 2
    assert first["span_s"] >= first["prefill_s"] + first["decode_s"]
    # The second burst's one prompt (12 tokens) never fills a step: arrivals, no phases.
    assert found[1]["arrivals"][0]["requests"] == 1 and "span_s" not in found[1]
