"""benchmarks/parallel_gpu.py's `--device cpu` path: a tiny Llama and a tiny DeepSeek-V3 checked
at two gloo ranks against one, then `ember serve --tensor-parallel-size 2` under the same client
and loads as on the GPUs at toy sizes; and the bytes a rank reads, which its roofline divides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_gpu import kv_bytes_per_token  # noqa: E402
from benchmarks.parallel_gpu import SHAPES, rank_step_bytes, serve_command  # noqa: E402
from benchmarks.quantized_gpu import decode_bytes  # noqa: E402


def test_parallel_gpu_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "parallel_gpu.py"), "--device", "cpu"]
    done = subprocess.run(
        [*cmd, "--starts", "warm"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [written] = tmp_path.glob("parallel_gpu-cpu-*-tiny.json")  # <bench>-<hardware>-<date>-<shape>
    report = json.loads(written.read_text())
    checks = report["correctness"]
    # float32 at two ranks is one rank's answer; bf16 is measured against one rank's float32.
    for model, key in (("tiny", "float32 tp2"), ("tiny_moe", "float32 dp-ep2")):
        run = checks[model]["runs"][key]
        assert run["ok"] and run["identical_frac"] == 1.0 and run["max_abs_logprob_gap"] < 1e-4
    for model, key in (("tiny", "bfloat16 tp2"), ("tiny_moe", "bfloat16 dp-ep2")):
        run = checks[model]["runs"][key]
        assert run["prompts"] == 8 and run["one_vs_float32_gap"] >= 0 and "ok" in run
    warm = report["speed"]["ember"]["2"]["warm"]
    assert warm["ready_s"] > 0 and warm["b1_tpot_ms"] > 0 and warm["b1_roofline_frac"] > 0
    assert warm["mixed"]["completed"] == 4 and warm["mixed"]["errors"] == 0
    assert warm["mixed"]["completion_tokens"] == 4 * 8  # ignore_eos: every token asked for
    assert len(report["copy_bytes_per_s"]["after"]) == 1
    assert "| tiny_moe | float32 dp-ep2 | 1.00 |" in done.stdout
    assert "| mixed, output tok/s |" in done.stdout


@pytest.mark.parametrize("shape", ["llama", "moonlight", "kimi_k25"])
def test_one_rank_reads_what_one_device_does(shape: str) -> None:
    cfg = {**SHAPES[shape], "num_hidden_layers": 4}
    assert rank_step_bytes(cfg, 1, 384)["total"] == pytest.approx(
        decode_bytes(cfg, 1, 384)["total"]
    )


def test_what_a_rank_keeps_whole() -> None:
    """Llama: everything but the norms halves at two ranks; past 8 ranks each keeps one KV
    head. MLA: every rank holds the whole latent cache."""
    llama = SHAPES["llama"]
    one, two = rank_step_bytes(llama, 1, 0), rank_step_bytes(llama, 2, 0)
    norms = (2 * llama["num_hidden_layers"] + 1) * llama["hidden_size"] * 2
    assert two["weights"] - norms == pytest.approx((one["weights"] - norms) / 2)
    kv = [rank_step_bytes(llama, n, 1)["kv"] for n in (1, 8, 16)]
    assert kv == [kv_bytes_per_token(llama), kv_bytes_per_token(llama) / 8, kv[1]]
    moon = SHAPES["moonlight"]
    assert rank_step_bytes(moon, 8, 1)["kv"] == kv_bytes_per_token(moon)


def test_data_parallel_attention_keeps_attention_whole() -> None:
    """Every rank holds all of MLA's weights: the difference to splitting by heads is the
    heads' share the other ranks would hold. A dense model has no latent attention to keep."""
    from benchmarks.quantized_gpu import bytes_per_param, param_groups

    moon = {**SHAPES["moonlight"], "num_hidden_layers": 4}
    split, whole = rank_step_bytes(moon, 4, 100), rank_step_bytes(moon, 4, 100, True)
    groups, per = param_groups(moon), bytes_per_param(moon)
    latent = moon["kv_lora_rank"] + moon["qk_rope_head_dim"] + (moon.get("q_lora_rank") or 0)
    heads = (
        groups["attention"] * per["attention"]
        - 4 * moon["hidden_size"] * latent * per["attention"]
        + groups["kv_b"] * per["kv_b"]
    )
    assert whole["weights"] - split["weights"] == pytest.approx(heads * 3 / 4)
    assert whole["kv"] == split["kv"]
    llama = SHAPES["llama"]
    assert rank_step_bytes(llama, 2, 9, True) == rank_step_bytes(llama, 2, 9)


def test_both_servers_get_the_parallel_flags() -> None:
    for engine in ("ember", "vllm"):
        cmd = serve_command(engine, "/models/m", 8000, "cuda", 4, True)
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
        assert "--enable-expert-parallel" in cmd
    assert "--enable-expert-parallel" not in serve_command("ember", "m", 1, "cpu", 2, False)
    ember = serve_command("ember", "m", 1, "cuda", 8, True, dp=True)
    assert ember[-3:] == ["8", "--enable-expert-parallel", "--enable-dp-attention"]
    vllm = serve_command("vllm", "m", 1, "cuda", 8, True, dp=True)
    assert "--tensor-parallel-size" not in vllm
    assert (
        vllm[vllm.index("--data-parallel-size") + 1] == "8" and "--enable-expert-parallel" in vllm
    )
