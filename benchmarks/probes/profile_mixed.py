"""Where the mixed load's time goes: 256 x (1024 in, 256 out) at once on the Llama-3.1-8B shape
(dummy weights), driven in-process with the engine's defaults (decode graphs, async scheduling),
split into its two phases: the prefill phase (every step that still prefills some prompt, decode
rows riding along) and the decode phase after it. For each phase: its wall time and steps, the
GPU's busy time (the union of its kernels' intervals, from torch.profiler), the time the GPU sat
idle, and the kernels' time by kind (GEMMs, attention, norms, ...), heaviest kernels listed.

A first pass runs unprofiled (the phase times a user sees); a second, on fresh prompts, runs
under the profiler (its wall times are inflated by the profiler; its kernel times are not).
Prints a table and writes JSON beside the engine benchmark's.

    python benchmarks/probes/profile_mixed.py [--prompts 256] [--prompt-len 1024] [--out-len 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import (  # noqa: E402
    SHAPES,
    active_params,
    ceilings,
    engine_config,
    random_prompts,
    shape_dir,
)

from ember.engine.core import EngineCore  # noqa: E402
from ember.engine.messages import EngineCoreRequest  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402

KINDS: list[tuple[str, tuple[str, ...]]] = [
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "splitk", "cublas")),
    ("attention", ("attn", "attention", "flash", "fmha", "cudnn", "prefill", "decode_")),
    ("norm", ("rms",)),
    ("activation", ("silu", "gelu")),
    ("rope / kv write", ("rotary", "rope", "write_kv", "kv_write")),
    ("sampling", ("sample", "argmax", "exponential", "softmax", "topk", "gumbel", "race")),
    ("copy / fill", ("copy", "memcpy", "memset", "fill", "cat", "index")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def in_prefill(core: EngineCore) -> bool:
    s = core.scheduler
    return bool(s.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running)


def add(core: EngineCore, prompts: list[list[int]], out_len: int, tag: str) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}{i}", p, params, [], max_tokens=out_len))


def phases(core: EngineCore) -> dict[str, Any]:
    """Step until done; the wall time and steps of each phase (a step counts as prefill when it
    was scheduled while some prompt was still unprefilled)."""
    out: dict[str, Any] = {
        p: {"wall_s": 0.0, "steps": 0, "host_busy_s": 0.0} for p in ("prefill", "decode")
    }
    generated = 0
    runner = core.runner
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        phase = "prefill" if in_prefill(core) else "decode"
        s0, waited0 = time.perf_counter(), runner.sync_wait_s
        generated += len(core.step())
        wall = time.perf_counter() - s0
        out[phase]["wall_s"] += wall
        out[phase]["steps"] += 1
        # The host's own time: the step's wall time less its waits for the GPU.
        out[phase]["host_busy_s"] += wall - (runner.sync_wait_s - waited0)
    out["wall_s"] = time.perf_counter() - t0
    out["generated"] = generated
    return out


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us in, ms out)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def kernel_summary(prof: profile, wall_ms: float) -> dict[str, Any]:
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    intervals: list[tuple[float, float]] = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = ev.device_time_total / 1e3
        by_kind[kind_of(ev.name)] += ms
        by_name[ev.name[:90]] += ms
        launches[ev.name[:90]] += 1
        intervals.append((ev.time_range.start, ev.time_range.end))
    busy = busy_ms(intervals)
    return {
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy,
        "gpu_idle_ms": max(wall_ms - busy, 0.0),
        "kernel_ms": sum(by_kind.values()),
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:20]),
        "launches": sum(launches.values()),
    }


def profiled_phases(core: EngineCore) -> dict[str, Any]:
    """The same load under the profiler, one profile per phase."""
    out: dict[str, Any] = {}
    for phase, running in (("prefill", lambda: in_prefill(core)), ("decode", lambda: True)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = 0
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while core.has_unfinished_requests() and running():
                core.step()
                steps += 1
            torch.cuda.synchronize()
        out[phase] = {"steps": steps, **kernel_summary(prof, (time.perf_counter() - t0) * 1e3)}
    return out


def set_decode_attention(spec: str) -> None:
    import ember.kernels.decode_attention as da

    parts = [int(x) for x in spec.split(",")]
    da.NUM_STAGES, da.HEAD_MAJOR = parts[0], bool(parts[1])
    if len(parts) > 2:
        da.BLOCK_N = parts[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--tag", default="")
    ap.add_argument("--kv-host-gb", type=float, default=None, help="the host KV tier (0: off)")
    ap.add_argument(
        "--blas", choices=["cublas", "cublaslt"], help="torch's BLAS library (default: torch's)"
    )
    ap.add_argument("--passes", type=int, default=1, help="unprofiled passes (each on new prompts)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled pass")
    ap.add_argument(
        "--decode-attention",
        metavar="STAGES,HEAD_MAJOR[,BLOCK_N]",
        help="the decode attention kernel's pipeline stages, grid order (0/1) and keys a tile "
        "for the whole engine (default: the kernel module's)",
    )
    ap.add_argument(
        "--decode-splits-per-sm",
        type=int,
        help="stage-1 programs per SM that choose_num_splits aims at (default: the module's)",
    )
    args = ap.parse_args()
    if args.decode_attention:
        set_decode_attention(args.decode_attention)
    if args.decode_splits_per_sm:
        import ember.kernels.decode_attention as da

        da.PROGRAMS_PER_SM = args.decode_splits_per_sm
        da.choose_num_splits.cache_clear()
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    ceil = ceilings()
    core = EngineCore(engine_config(shape_dir(args.shape), kv_host_gb=args.kv_host_gb))
    vocab = core.model_config.vocab_size
    n, length, out_len = args.prompts, args.prompt_len, args.out_len
    add(core, random_prompts(n, length, vocab, 1), 16, "warm")  # compile, fill the allocator
    phases(core)
    passes = []
    for i in range(args.passes):
        add(core, random_prompts(n, length, vocab, 13 + 100 * i), out_len, f"run{i}-")
        passes.append(phases(core))
    plain = passes[0]
    prof: dict[str, Any] = {}
    if not args.no_profile:
        add(core, random_prompts(n, length, vocab, 14), out_len, "prof")
        prof = profiled_phases(core)
    gpu = torch.cuda.get_device_name()
    flops = 2 * active_params(SHAPES[args.shape]) * n * length
    pre = plain["prefill"]
    result = {
        "gpu": gpu,
        "shape": args.shape,
        "load": {"prompts": n, "prompt_len": length, "out_len": out_len},
        "kv_host_gb": args.kv_host_gb,
        "blas": str(torch.backends.cuda.preferred_blas_library()),
        "decode_attention": args.decode_attention,
        "decode_splits_per_sm": args.decode_splits_per_sm,
        "ceilings": ceil,
        "unprofiled": plain,
        "passes": passes,
        "output_tok_s": plain["generated"] / plain["wall_s"],
        "prefill_phase_tok_s": n * length / pre["wall_s"],
        "prefill_phase_matmul_frac": flops / pre["wall_s"] / ceil["matmul_flops"],
        "profiled": prof,
    }
    print(f"\n## {gpu}, {args.shape}: {n} x ({length} in, {out_len} out), in-process, defaults")
    print(
        f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e9:,.0f} GB/s, "
        f"matmul {ceil['matmul_flops'] / 1e12:.0f} TFLOP/s"
    )
    print(
        f"unprofiled: {result['output_tok_s']:,.0f} output tok/s, {plain['wall_s']:.2f} s; "
        f"prefill phase {pre['wall_s']:.2f} s in {pre['steps']} steps "
        f"({result['prefill_phase_tok_s']:,.0f} prompt tok/s, "
        f"{result['prefill_phase_matmul_frac']:.2f} of the matmul peak); decode phase "
        f"{plain['decode']['wall_s']:.2f} s in {plain['decode']['steps']} steps; host busy "
        f"{pre['host_busy_s']:.2f} s / {plain['decode']['host_busy_s']:.2f} s of them"
    )
    for i, p in enumerate(passes[1:], 1):
        print(
            f"pass {i}: {p['generated'] / p['wall_s']:,.0f} output tok/s, {p['wall_s']:.2f} s; "
            f"prefill phase {p['prefill']['wall_s']:.2f} s, decode {p['decode']['wall_s']:.2f} s"
        )
    for phase, p in prof.items():
        print(
            f"\n### profiled {phase} phase: {p['steps']} steps, wall {p['wall_ms']:.0f} ms, "
            f"GPU busy {p['gpu_busy_ms']:.0f} ms, idle {p['gpu_idle_ms']:.0f} ms, "
            f"{p['launches']} kernels"
        )
        print("| kind | ms | share of busy |")
        print("|---|---|---|")
        for kind, ms in p["by_kind_ms"].items():
            print(f"| {kind} | {ms:.1f} | {ms / max(p['gpu_busy_ms'], 1e-9):.1%} |")
        print("| kernel | ms |")
        print("|---|---|")
        for name, ms in list(p["top_kernels_ms"].items())[:12]:
            print(f"| {name} | {ms:.1f} |")
    out = Path(os.environ.get("OUT") or "benchmarks/results")
    name = f"profile_mixed-{args.shape}-{gpu.replace(' ', '_')}{args.tag}.json"
    (out / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
