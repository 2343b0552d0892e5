"""The MLA decode kernel's launch parameters swept on the shapes decode meets: splits per
sequence, latent rows per tile (BLOCK_N), warps, at batch 1 to 64 and 512 to 4096 tokens of
context, for Moonlight's 16 heads and Kimi K2's 64 (rank 512, rope 64, page 16, bf16).

Each case is timed as the engine runs it: a CUDA graph (here a chain of 40 calls, so one replay's
own cost is spread thin), split kernel and merge together. "graph default" is what the engine
picks inside a captured graph, where the split count is sized by the longest context the graph
may meet (max_seq_len = the model's length, 8192 here), not by the batch's.

    python benchmarks/probes/mla_decode_sweep.py [--int64-lens]

`--int64-lens`: seq_lens as int64, as the engine's decode graphs hold them (the eager path's are
int32; the GQA decode kernel's speed followed that dtype, docs/performance.md).

Prints a table per shape and writes $OUT/mla_decode_sweep-<GPU>.json (or benchmarks/results/).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import graph_ms  # noqa: E402

from ember.kernels.mla_decode import mla_decode  # noqa: E402

RANK, ROPE, PAGE, MAX_LEN = 512, 64, 16, 8192
CHAIN = 40


def case(batch: int, ctx: int, heads: int):
    g = torch.Generator(device="cuda").manual_seed(batch * ctx + heads)
    blocks = batch * (ctx // PAGE)
    cache = torch.randn(blocks, 1, PAGE, 1, RANK + ROPE, device="cuda", generator=g).bfloat16()
    tables = torch.randperm(blocks, device="cuda", generator=g).view(batch, -1).int()
    dtype = torch.int64 if "--int64-lens" in sys.argv else torch.int32
    seq_lens = torch.full((batch,), ctx, dtype=dtype, device="cuda")
    ql = torch.randn(batch, heads, RANK, device="cuda", generator=g).bfloat16()
    qr = torch.randn(batch, heads, ROPE, device="cuda", generator=g).bfloat16()
    return ql, qr, cache, seq_lens, tables


def graph_us(fn) -> float:
    return graph_ms(fn, iters=10, chain=CHAIN) * 1e3


def main() -> None:
    name = torch.cuda.get_device_name()
    results = []
    for heads, (batch, ctx) in itertools.product(
        (16, 64), ((1, 512), (1, 4096), (8, 1024), (64, 1024))
    ):
        args = (*case(batch, ctx, heads), (128 + ROPE) ** -0.5)

        def run(args=args, **kw):
            return lambda: mla_decode(*args, **kw)

        want = run(max_seq_len=ctx, num_splits=1)()
        rows = {"graph default": graph_us(run(max_seq_len=MAX_LEN))}
        for splits, block_n, warps in itertools.product((4, 8, 16, 32, 64), (16, 32), (4, 8)):
            fn = run(num_splits=splits, block_n=block_n, num_warps=warps)
            err = (fn().float() - want.float()).abs().max().item()
            if err > 2e-2:
                raise AssertionError(f"splits {splits} block_n {block_n}: max error {err}")
            rows[f"splits {splits}, BLOCK_N {block_n}, {warps} warps"] = graph_us(fn)
        best = min(rows, key=rows.get)
        kv_bytes = batch * ctx * (RANK + ROPE) * 2
        print(f"\n## {heads} heads, batch {batch} x {ctx} ({kv_bytes / 2**20:.1f} MiB of latents)")
        print("| config | us |\n|---|---|")
        for k, v in sorted(rows.items(), key=lambda kv: kv[1])[:6]:
            print(f"| {k} | {v:.1f} |")
        print(f"| graph default | {rows['graph default']:.1f} |")
        results.append({"heads": heads, "batch": batch, "ctx": ctx, "us": rows, "best": best})
    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "results"))
    lens = "int64" if "--int64-lens" in sys.argv else "int32"
    tag = "-int64-lens" if lens == "int64" else ""
    out = out_dir / f"mla_decode_sweep-{name.replace(' ', '_')}{tag}.json"
    out.write_text(json.dumps({"gpu": name, "seq_lens": lens, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
