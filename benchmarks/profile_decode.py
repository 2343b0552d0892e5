"""Where a decode step's GPU time goes, kernel by kernel (torch.profiler), on the Llama-3.1-8B
shape with dummy weights: batch 1 (512-token context) and batch 128 (1k context), eager mode so
that each kernel is attributed. Prints a table per batch and writes JSON beside the engine
benchmark's.

    python benchmarks/profile_decode.py
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import engine_config, random_prompts, shape_dir  # noqa: E402

from ember.engine.core import EngineCore  # noqa: E402
from ember.engine.messages import EngineCoreRequest  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402


def kernel_table(core: EngineCore, batch: int, context: int, steps: int = 8) -> dict[str, float]:
    params = SamplingParams(temperature=1.0, max_tokens=steps + 4, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, context, 128256, batch)):
        core.add_request(EngineCoreRequest(f"p{batch}-{i}", p, params, [], steps + 4))
    for _ in range(3):  # prefill (chunked if needed) and a first decode step, unprofiled
        core.step()
    while core.scheduler.waiting:
        core.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
    totals: dict[str, float] = defaultdict(float)
    launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:90]] += ev.device_time_total / 1e3 / steps  # ms per step
            launches += 1
    totals["(kernel launches per step)"] = launches / steps
    while core.has_unfinished_requests():
        core.step()
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    # Eager, so that the profiler can name every kernel.
    core = EngineCore(engine_config(shape_dir("llama"), enforce_eager=True))
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "tables": {}}
    for batch, context in ((1, 512), (128, 1024)):
        table = kernel_table(core, batch, context)
        launches = table.pop("(kernel launches per step)")
        total = sum(table.values())
        result["tables"][f"b{batch}"] = {"total_ms": total, "launches": launches, "kernels": table}
        print(
            f"\n## decode batch {batch}, context {context}: {total:.3f} ms of kernels, "
            f"{launches:.0f} launches per step"
        )
        print("| kernel | ms/step | share |")
        print("|---|---|---|")
        for name, ms in list(table.items())[:14]:
            print(f"| {name} | {ms:.3f} | {ms / total:.1%} |")
    out = Path(os.environ.get("OUT") or "benchmarks/results")
    (out / f"profile_decode-{gpu.replace(' ', '_')}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
