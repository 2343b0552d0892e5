"""The floor under a batch-1 decode step: what one kernel of a CUDA graph costs when it does
almost nothing, and what the card's memory moves at, measured in the same run.

A batch-1 step of an MoE model is hundreds of dependent kernels, most of them reading a few MB;
each pays the graph's launch-to-launch latency and its own ramp (first loads in flight, the tail
of its last wave). This measures that floor directly: a graph of N dependent kernels that each
read and write one value (a Triton kernel, and torch's elementwise add), with and without
programmatic dependent launch (PDL: the next kernel may start while the previous one drains,
where Triton supports it), against the copy bandwidth that sets the roofline.

    python benchmarks/probes/launch_floor.py [--kernels 800]

Prints a table and writes benchmarks/results/launch_floor-<GPU>.json (or $OUT/...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import copy_bandwidth, graph_ms  # noqa: E402


@triton.jit
def _bump_kernel(x_ptr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible past this point
    v = tl.load(x_ptr)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr, v + 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=800)
    args = ap.parse_args()
    n = args.kernels
    x = torch.zeros(1, device="cuda")
    v = torch.zeros(2048, dtype=torch.bfloat16, device="cuda")
    one = torch.ones_like(v)
    rows: dict[str, float | str] = {}

    def graph_us_per_kernel(body, n: int) -> float:
        return graph_ms(body, iters=20, chain=n) * 1e3

    rows["triton, one value"] = graph_us_per_kernel(lambda: _bump_kernel[(1,)](x, PDL=False), n)
    try:
        rows["triton + PDL, one value"] = graph_us_per_kernel(
            lambda: _bump_kernel[(1,)](x, PDL=True, launch_pdl=True), n
        )
    except Exception as exc:  # PDL needs Hopper and a Triton that launches with it
        rows["triton + PDL, one value"] = f"unsupported: {type(exc).__name__}: {exc}"[:200]
    rows["torch add, 2048 bf16"] = graph_us_per_kernel(lambda: v.add_(one), n)
    gbps = copy_bandwidth() / 1e9
    name = torch.cuda.get_device_name()
    print(f"## {name}: one kernel of a CUDA graph of {n}, and the copy bandwidth\n")
    print("| kernel | us per kernel |\n|---|---|")
    for k, val in rows.items():
        print(f"| {k} | {val if isinstance(val, str) else f'{val:.2f}'} |")
    print(f"\ncopy bandwidth: {gbps:.0f} GB/s")
    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "results"))
    out = out_dir / f"launch_floor-{name.replace(' ', '_')}.json"
    out.write_text(
        json.dumps({"gpu": name, "kernels": n, "us_per_kernel": rows, "copy_gbps": gbps})
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
