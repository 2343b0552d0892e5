"""Where a step's GPU time goes, kernel by kernel (torch.profiler), on a shape of engine_gpu.py
(Llama-3.1-8B by default; --shape moonlight for the MLA/MoE one) with dummy weights: decode at
batch 1 (512-token context) and batch 128 (1k context), one prefill step of 8 x 2048 tokens, and
mixed steps (16 requests decoding, a new 64-token prompt each step: no graph, as a lightly loaded
server runs them); eager mode so that each kernel is attributed. Each table also gives the step's
wall time and the GPU's idle time between kernels, so the time between kernels shows.
With --graphs the decode steps replay the engine's CUDA graphs (as served): the idle time
between kernels is then the launches' own ramp and drain, what fusing kernels could win (the wall
time is then the profiler's, ~0.5 s a step with graph kernels traced: each decode table also
times as many steps again without the profiler, its "step_ms").
Prints a table per case and writes JSON beside the engine benchmark's.

With --host: the host's side of mixed steps (cProfile) and one small kernel's launch cost.

    python benchmarks/probes/profile_steps.py [--shape llama] [--graphs | --host]
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

from engine_gpu import SHAPES, engine_config, random_prompts, shape_dir  # noqa: E402

from ember.engine.core import EngineCore  # noqa: E402
from ember.engine.messages import EngineCoreRequest  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402


def kernels_of(prof: profile, steps: int) -> dict[str, Any]:
    """{"kernels": ms per step of each kernel (by name), "launches_by_kernel": its launches per
    step, "gaps": the GPU's idle time between kernels}, kernels heaviest first."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    spans: list[tuple[float, float]] = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:90]] += ev.device_time_total / 1e3 / steps  # ms per step
            counts[ev.name[:90]] += 1 / steps
            spans.append((ev.time_range.start, ev.time_range.end))
    kernels = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    return {"kernels": kernels, "launches_by_kernel": dict(counts), "gaps": gaps(spans, steps)}


def gaps(spans: list[tuple[float, float]], steps: int, boundary_us: float = 20.0) -> dict:
    """The GPU's idle time a step (ms) from kernel start/end times (us): gaps shorter than
    boundary_us are kernel boundaries (a launch's ramp and drain: inside a CUDA graph, what
    fusing kernels could win; programmatic dependent launch did not, docs/performance.md),
    longer ones the host between steps. Overlapping kernels count once."""
    inner = outer = 0.0
    inner_n = 0
    end = None
    for s, e in sorted(spans):
        if end is not None and s > end:
            if s - end < boundary_us:
                inner, inner_n = inner + s - end, inner_n + 1
            else:
                outer += s - end
        end = e if end is None else max(end, e)
    return {
        "boundary_ms": inner / 1e3 / steps,
        "boundaries": inner_n / steps,
        "between_steps_ms": outer / 1e3 / steps,
    }


def _vocab(core: EngineCore) -> int:
    return core.runner.config.vocab_size


def decode_table(core: EngineCore, batch: int, context: int, steps: int = 8) -> dict[str, Any]:
    tokens = 2 * steps + 4  # the profiled steps, then as many timed without the profiler
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, context, _vocab(core), batch)):
        core.add_request(EngineCoreRequest(f"p{batch}-{i}", p, params, [], tokens))
    for _ in range(3):  # prefill (chunked if needed) and a first decode step, unprofiled
        core.step()
    while core.scheduler.waiting:
        core.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    while core.has_unfinished_requests():
        core.step()
    return {"wall_ms": wall, "step_ms": step_ms, **kernels_of(prof, steps)}


def _sync(core: EngineCore) -> None:
    if core.device.type == "cuda":
        torch.cuda.synchronize(core.device)


def mixed_table(
    core: EngineCore,
    decodes: int = 16,
    chunk: int = 64,
    context: int = 512,
    steps: int = 8,
    host: Any = None,
) -> dict[str, Any]:
    """Mixed steps as a lightly loaded server runs them (where a light load's step time goes): `decodes`
    requests decoding while every step also prefills one new prompt of `chunk` tokens, so no
    step is decode-only and none replays a graph. Each step's wall time unprofiled (`step_ms`)
    against its kernels' time (profiled): where the step is longer than its kernels, the host's
    launches are what the step waits for. With `host` (a cProfile.Profile) the timed steps run
    under it instead, and the kernels are not profiled."""
    vocab = _vocab(core)
    budget = 4 * steps + 8  # the decoders outlive every timed step
    params = SamplingParams(temperature=1.0, max_tokens=budget, ignore_eos=True)
    for i, p in enumerate(random_prompts(decodes, context, vocab, 7)):
        core.add_request(EngineCoreRequest(f"mixed-d{i}", p, params, [], budget))
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    one = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    prompts = iter(random_prompts(3 * steps + 4, chunk, vocab, 8))
    serial = iter(range(1 << 30))

    def mixed_step() -> None:
        core.add_request(EngineCoreRequest(f"mixed-c{next(serial)}", next(prompts), one, [], 1))
        core.step()

    for _ in range(2):
        mixed_step()
    _sync(core)
    if host is not None:
        host.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        mixed_step()
    _sync(core)
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    if host is not None:
        host.disable()
        while core.has_unfinished_requests():
            core.step()
        return {"step_ms": step_ms}
    activities = [ProfilerActivity.CUDA] if core.device.type == "cuda" else [ProfilerActivity.CPU]
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            mixed_step()
        _sync(core)
    wall = (time.perf_counter() - t0) * 1e3 / steps
    while core.has_unfinished_requests():
        core.step()
    return {"wall_ms": wall, "step_ms": step_ms, **kernels_of(prof, steps)}


def host_profile(core: EngineCore, chunk: int, steps: int = 8, lines: int = 40) -> dict[str, Any]:
    """The host's side of mixed steps (`mixed_table`'s, a new prompt of `chunk` tokens each):
    their unprofiled wall time, then cProfile's functions by own time over as many steps (its
    own overhead inflates every call, so read the shares, not the totals)."""
    import cProfile
    import io
    import pstats

    plain = mixed_table(core, chunk=chunk, steps=steps)["step_ms"]
    prof = cProfile.Profile()
    mixed_table(core, chunk=chunk, steps=steps, host=prof)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return {"chunk": chunk, "step_ms": plain, "stats": text.getvalue()}


def launch_costs(n: int = 2000) -> dict[str, float]:
    """Host microseconds a call of one small kernel, eager, back to back (the GPU idles: each
    is the launch's own cost): ember's Triton RMSNorm, torch's matmul (cuBLAS) and torch's add."""
    from ember.kernels.rmsnorm import rms_norm

    x = torch.randn(80, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    calls = {
        "triton rms_norm": lambda: rms_norm(x, w, 1e-5),
        "torch matmul": lambda: x @ m,
        "torch add": lambda: x + x,
    }
    result = {}
    for name, call in calls.items():
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        result[name] = (time.perf_counter() - t0) * 1e6 / n
        torch.cuda.synchronize()
    return result


def prefill_table(core: EngineCore, n: int = 8, length: int = 2048) -> dict[str, Any]:
    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    for rep in ("warm", "run"):
        for i, p in enumerate(random_prompts(n, length, _vocab(core), 100 + len(rep))):
            core.add_request(EngineCoreRequest(f"{rep}-{i}", p, params, [], 1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps = 0
            while core.has_unfinished_requests():
                core.step()
                steps += 1
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    prefill_steps = -(-n * length // core.resolved.max_num_batched_tokens)
    return {"wall_ms": wall / prefill_steps, **kernels_of(prof, prefill_steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama", choices=sorted(SHAPES))
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="decode steps from the engine's CUDA graphs (batch 1 and 128 only): the kernels "
        "and the idle time between them as a served step pays them",
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="the host's side instead: mixed steps (new prompts of 64 and 1,024 tokens) under "
        "cProfile, and one small kernel's launch cost",
    )
    args = ap.parse_args()
    # Eager by default, so that the profiler can attribute every launch to its step.
    core = EngineCore(engine_config(shape_dir(args.shape), enforce_eager=not args.graphs))
    gpu = torch.cuda.get_device_name()
    if args.host:
        host = {"gpu": gpu, "launch_us": launch_costs()}
        print("launch cost, us a call:", {k: round(v, 1) for k, v in host["launch_us"].items()})
        for chunk in (64, 1024):
            host[f"mixed-{chunk}"] = found = host_profile(core, chunk)
            print(f"\n## mixed steps, a new {chunk}-token prompt each: {found['step_ms']:.2f} ms")
            print(found["stats"])
        out = Path(os.environ.get("OUT") or "benchmarks/results")
        (out / f"profile_host-{args.shape}-{gpu.replace(' ', '_')}.json").write_text(
            json.dumps(host, indent=2)
        )
        return
    result = {"gpu": gpu, "shape": args.shape, "graphs": args.graphs, "tables": {}}
    cases = {
        "b1": ("decode batch 1, context 512", lambda: decode_table(core, 1, 512)),
        "b128": ("decode batch 128, context 1024", lambda: decode_table(core, 128, 1024)),
        "prefill": ("prefill 8 x 2048 in one step", lambda: prefill_table(core)),
        "mixed": (
            "mixed steps: 16 decoding, one new 64-token prompt each step",
            lambda: mixed_table(core),
        ),
    }
    if args.graphs:
        del cases["prefill"]  # (the mixed steps stay: they are eager either way, as served)
    for key, (title, measure) in cases.items():
        measured = measure()
        table, counts, wall = (
            measured["kernels"],
            measured["launches_by_kernel"],
            measured["wall_ms"],
        )
        total, launches = sum(table.values()), sum(counts.values())
        result["tables"][key] = {"total_ms": total, "launches": launches, **measured}
        idle = measured["gaps"]
        print(
            f"\n## {title}: {total:.3f} ms of kernels in {wall:.3f} ms of wall time, "
            f"{launches:.0f} launches per step; idle between kernels "
            f"{idle['boundary_ms']:.3f} ms ({idle['boundaries']:.0f} gaps), between steps "
            f"{idle['between_steps_ms']:.3f} ms"
            + (f"; {measured['step_ms']:.3f} ms a step unprofiled" if "step_ms" in measured else "")
        )
        print("| kernel | ms/step | share | launches/step | us each |")
        print("|---|---|---|---|---|")
        for name, ms in list(table.items())[:24]:
            n = counts.get(name, 0)
            each = f"{ms * 1e3 / n:.1f}" if n else "-"
            print(f"| {name} | {ms:.3f} | {ms / total:.1%} | {n:.0f} | {each} |")
    out = Path(os.environ.get("OUT") or "benchmarks/results")
    mode = "-graphs" if args.graphs else ""
    (out / f"profile_steps-{args.shape}{mode}-{gpu.replace(' ', '_')}.json").write_text(
        json.dumps(result, indent=2)
    )


if __name__ == "__main__":
    main()
