"""Time to first token of prompts alone on the Moonlight shape (MLA + MoE, dummy bf16 weights),
in process on one GPU, and where the time of a short prompt's step goes.

For each configuration (`--configs`: `pieces`, the engine's defaults; `eager`, no piecewise
graphs): one engine, a warm-up, then per prompt length (`--lengths`, 128 and 16,384 by
default) `--repeats` prompts of fresh random tokens, one at a time, one output token each:
the median and the spread of their TTFT. For the 128-token prompt also a profile of one such
step (torch.profiler): the wall time of the step, the GPU's kernel time, and the kernels and
host calls that take most of it.

    python benchmarks/probes/mla_ttft.py [--lengths 128,16384] [--configs pieces,eager]

Prints a table and writes mla_ttft-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_turn import first_token_s  # noqa: E402
from engine_gpu import engine_config, random_prompts, shape_dir  # noqa: E402
from result_names import result_path  # noqa: E402

CONFIGS = {"pieces": {}, "eager": {"max_piecewise_tokens": 0}}


def profile_step(core, prompt: list[int]) -> dict:  # type: ignore[no-untyped-def]
    """One prompt's first token under torch.profiler: wall, GPU kernel time, the top kernels
    and the top host operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = first_token_s(core, "profiled", prompt)
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    by_gpu = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "wall_ms": wall * 1e3,
        "gpu_kernel_ms": gpu_us / 1e3,
        "top_kernels": [
            {"name": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count}
            for e in by_gpu
        ],
        "top_host": [
            {"name": e.key[:90], "ms": e.self_cpu_time_total / 1e3, "calls": e.count}
            for e in by_cpu
        ],
    }


def run_config(name: str, lengths: list[int], repeats: int) -> dict:
    from ember.engine.core import EngineCore

    top = max(lengths) + 16
    core = EngineCore(
        engine_config(shape_dir("moonlight"), max_model_len=max(top, 4096), **CONFIGS[name])
    )
    vocab = core.model_config.vocab_size
    try:
        for i, p in enumerate(random_prompts(3, 128, vocab, 7)):
            first_token_s(core, f"warm{i}", p)
        out: dict = {"pieces_captured": sorted(core.runner.piecewise.captured)}
        for n in lengths:
            times = [
                first_token_s(core, f"{name}-{n}-{i}", p) * 1e3
                for i, p in enumerate(random_prompts(repeats, n, vocab, n))
            ]
            out[str(n)] = {
                "ttft_ms_p50": statistics.median(times),
                "ttft_ms_min": min(times),
                "ttft_ms_max": max(times),
                "all_ms": times,
            }
        out["profile_128"] = profile_step(core, random_prompts(1, 128, vocab, 1234)[0])
        return out
    finally:
        core.close()
        del core
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="128,16384")
    ap.add_argument("--configs", default="pieces,eager")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    gpu = torch.cuda.get_device_name(0)
    report: dict = {"gpu": gpu, "shape": "moonlight", "lengths": lengths, "configs": {}}
    for name in args.configs.split(","):
        t0 = time.perf_counter()
        report["configs"][name] = run_config(name, lengths, args.repeats)
        report["configs"][name]["seconds"] = time.perf_counter() - t0
    print(f"## MLA TTFT, Moonlight shape, {gpu}")
    print("| config | " + " | ".join(f"{n} tokens p50 (min-max) ms" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for name, r in report["configs"].items():
        cells = [
            f"{r[str(n)]['ttft_ms_p50']:.1f} ({r[str(n)]['ttft_ms_min']:.1f}-"
            f"{r[str(n)]['ttft_ms_max']:.1f})"
            for n in lengths
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
        prof = r["profile_128"]
        print(
            f"  128-token step: wall {prof['wall_ms']:.1f} ms, kernels {prof['gpu_kernel_ms']:.1f}"
        )
    hw = gpu.replace("NVIDIA ", "").replace(" ", "-")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parents[1] / "results")
    out = result_path("mla_ttft", hw, out_dir=out_dir)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
