"""benchmarks/served_gpu.py's batch-1 roofline: the bytes a step reads, counted by hand for the 8B
shape, and each run's fraction from its TPOT against the higher copy rate of the report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import served_gpu  # noqa: E402
from engine_gpu import SHAPES  # noqa: E402


def test_b1_bytes_are_the_8b_weights_a_token_reads_and_the_mean_context_kv() -> None:
    h, inter, layers, vocab = 4096, 14336, 32, 128256
    q_o = 2 * h * h
    k_v = 2 * h * 8 * 128
    per_layer = q_o + k_v + 3 * h * inter + 2 * h  # attention, MLP, two norms
    params = layers * per_layer + vocab * h + h  # the LM head and the final norm, no embedding
    kv_per_token = layers * 2 * 8 * 128 * 2
    want = 2 * params + (128 + 512 / 2) * kv_per_token
    assert served_gpu.b1_bytes(SHAPES["llama"], served_gpu.GPU_LOADS) == pytest.approx(want)
    assert 15.0e9 < want < 15.1e9


def test_roofline_fracs_use_the_higher_copy_rate_and_skip_runs_without_b1() -> None:
    report = {
        "b1_bytes": 15e9,
        "copy_bytes_per_s": [4.0e12, 4.2e12],
        "engines": {
            "ember": {"fresh": {"b1_tpot_ms": 4.5}, "warm": {"b1_tpot_ms": 5.0}},
            "vllm": {"fresh": {"ready_s": 100.0}, "first_minute": {"worst": 1.0}},
        },
    }
    served_gpu.roofline_fracs(report)
    floor_ms = 15e9 / 4.2e12 * 1e3
    ember = report["engines"]["ember"]
    assert ember["fresh"]["b1_roofline_frac"] == pytest.approx(floor_ms / 4.5)
    assert ember["warm"]["b1_roofline_frac"] == pytest.approx(floor_ms / 5.0)
    assert "b1_roofline_frac" not in report["engines"]["vllm"]["fresh"]
