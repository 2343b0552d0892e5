"""The fused MoE kernel's tiles, swept on one GPU: for the expert dims of Moonlight-16B-A3B and
Qwen3-30B-A3B and token counts from decode (1) to prefill (8192), the GPU time of the whole routed
MoE (align_by_expert and both grouped GEMMs, replayed from a CUDA graph so that launch gaps do
not count) for each candidate tile config, against the same work done dense (torch.bmm over
[E, T * k / E, H], equal flops and weight bytes) and against the bandwidth of the weights the
batch's routes hit. Prints a table per shape and writes JSON.

    python benchmarks/moe_kernel.py [--shapes moonlight,qwen3_moe] [--tokens 1,64,256,2048,8192]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import SHAPES, ceilings, graph_ms, moe_dims  # noqa: E402

from ember.kernels.activation import silu_and_mul  # noqa: E402
from ember.kernels.fused_moe import align_by_expert, fused_moe, tile_config  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CANDIDATES = [
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
    cfg = SHAPES[name]
    _, experts, top_k = moe_dims(cfg)
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, h, device="cuda", generator=g).bfloat16() / h**0.5
    w2 = torch.randn(experts, h, inter, device="cuda", generator=g).bfloat16() / inter**0.5
    rows: dict[str, object] = {}
    for t in tokens:
        x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
        logits = torch.randn(t, experts, device="cuda", generator=g)
        weights, chosen = torch.softmax(logits, -1).topk(top_k, dim=-1)
        want = fused_moe(x, w13, w2, weights, chosen)
        flops = 6 * t * top_k * h * inter
        hit = experts * (1 - (1 - top_k / experts) ** t)
        floor_ms = hit * 3 * h * inter * 2 / bw * 1e3
        default = tile_config(t * top_k, experts)
        row: dict[str, object] = {
            "default": default,
            "align_ms": graph_ms(
                lambda c=chosen, d=default: align_by_expert(c, experts, d["BLOCK_M"])
            ),
            "bandwidth_floor_ms": floor_ms,
            "configs": {},
        }
        for cand in CANDIDATES:
            conf = as_config(cand)
            got = fused_moe(x, w13, w2, weights, chosen, config=conf)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            ms = graph_ms(lambda x=x, w=weights, c=chosen, f=conf: fused_moe(x, w13, w2, w, c, f))
            row["configs"][str(cand)] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}
        row["default_ms"] = graph_ms(lambda x=x, w=weights, c=chosen: fused_moe(x, w13, w2, w, c))
        per = t * top_k // experts
        if per:
            xs = torch.randn(experts, per, h, device="cuda", generator=g).bfloat16()

            def dense(xs: torch.Tensor = xs, per: int = per) -> torch.Tensor:
                a = torch.bmm(xs, w13.transpose(1, 2)).view(-1, 2 * inter)
                return torch.bmm(silu_and_mul(a).view(experts, per, inter), w2.transpose(1, 2))

            row["dense_bmm_ms"] = graph_ms(dense)
            row["dense_bmm_tflops"] = 6 * experts * per * h * inter / row["dense_bmm_ms"] / 1e9
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
