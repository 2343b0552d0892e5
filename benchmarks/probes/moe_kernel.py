"""The fused MoE kernel's tiles, swept on one GPU: for the expert dims of Moonlight-16B-A3B and
Qwen3-30B-A3B and token counts from decode (1) to prefill (8192), the GPU time of the whole routed
MoE (align_by_expert and both grouped GEMMs, replayed from a CUDA graph so that launch gaps do
not count) for each candidate tile config, against the same work done dense (torch.bmm over
[E, T * k / E, H], equal flops and weight bytes) and against the bandwidth of the weights the
batch's routes hit. Prints a table per shape and writes JSON.

    python benchmarks/probes/moe_kernel.py [--shapes moonlight,qwen3_moe] [--tokens 1,64,256,2048,8192]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import SHAPES, MoeLayerCase, ceilings, graph_ms  # noqa: E402

from ember.kernels.fused_moe import align_by_expert, fused_moe, tile_config  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CANDIDATES = [
    (16, 32, 128, 4, 3),
    (16, 32, 256, 4, 3),
    (16, 64, 256, 4, 4),
    (16, 64, 128, 4, 3),
    (16, 128, 128, 4, 3),
    (16, 64, 256, 4, 3),
    (16, 128, 64, 4, 4),
    (32, 64, 128, 4, 3),
    (32, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 64, 64, 4, 3),
    (128, 128, 64, 8, 4),
    (64, 256, 64, 8, 3),
]


def as_config(c: tuple[int, int, int, int, int]) -> dict[str, int]:
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return dict(zip(keys, c, strict=True))


def bench(name: str, tokens: list[int], bw: float) -> dict[str, object]:
    case = MoeLayerCase(SHAPES[name])
    w13, w2, experts = case.w13, case.w2, case.experts
    rows: dict[str, object] = {}
    for t in tokens:
        x, weights, chosen = case.inputs(t)
        want = fused_moe(x, w13, w2, weights, chosen)
        flops = case.flops(t)
        default = tile_config(t * case.top_k, experts)
        row: dict[str, object] = {
            "default": default,
            "align_ms": graph_ms(
                lambda c=chosen, d=default: align_by_expert(c, experts, d["BLOCK_M"])
            ),
            "bandwidth_floor_ms": case.floor_ms(t, bw),
            "configs": {},
        }
        for cand in CANDIDATES:
            conf = as_config(cand)
            got = fused_moe(x, w13, w2, weights, chosen, config=conf)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            ms = graph_ms(lambda x=x, w=weights, c=chosen, f=conf: fused_moe(x, w13, w2, w, c, f))
            row["configs"][str(cand)] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}
        row["default_ms"] = graph_ms(lambda x=x, w=weights, c=chosen: fused_moe(x, w13, w2, w, c))
        dense_ms = case.dense_bmm_ms(t)
        if dense_ms is not None:
            row["dense_bmm_ms"] = dense_ms
            row["dense_bmm_tflops"] = flops / dense_ms / 1e9
        best = min(row["configs"].items(), key=lambda kv: kv[1]["ms"])
        row["best"] = best[0]
        row["best_ms"] = best[1]["ms"]
        row["tflops_default"] = flops / row["default_ms"] / 1e9
        rows[str(t)] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="moonlight,qwen3_moe")
    ap.add_argument("--tokens", default="1,64,256,2048,8192")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    ceil = ceilings()
    tokens = [int(t) for t in args.tokens.split(",")]
    result = {"gpu": gpu, "ceilings": ceil, "shapes": {}}
    for name in args.shapes.split(","):
        result["shapes"][name] = bench(name, tokens, ceil["copy_bytes_per_s"])
    out = Path(os.environ.get("OUT") or "benchmarks/results")
    (out / f"moe_kernel-{gpu.replace(' ', '_')}.json").write_text(json.dumps(result, indent=2))
    print(f"GPU: {gpu}; copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    for name, rows in result["shapes"].items():
        print(f"\n## {name}")
        print(
            "| tokens | align us | default us | best (config) us | floor us | dense bmm us | "
            "default TFLOP/s | fused/dense |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for t, r in rows.items():
            dense = r.get("dense_bmm_ms")
            ratio = f"{r['dense_bmm_ms'] / r['best_ms']:.2f}" if dense else "-"
            print(
                f"| {t} | {r['align_ms'] * 1e3:.0f} | {r['default_ms'] * 1e3:.0f} | "
                f"{r['best_ms'] * 1e3:.0f} {r['best']} | {r['bandwidth_floor_ms'] * 1e3:.0f} | "
                f"{dense * 1e3 if dense else float('nan'):.0f} | {r['tflops_default']:.1f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
