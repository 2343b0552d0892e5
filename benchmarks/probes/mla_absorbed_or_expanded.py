"""Where MLA's prefill should switch from attending in the latent space (absorbed: each new token
a query of the Triton MLA decode kernel over its causal prefix) to expanding the context to
per-head K and V (torch's fused attention): both timed on one sequence of `new` tokens over a
cached prefix of `prefix` tokens, bf16, at Moonlight's 16 heads and Kimi K2.5's 64 (rank 512 +
64 rope, nope 128, v 128). The engine's rule is ember.attention.mla.EXPAND_MIN_QUERY.

    python benchmarks/probes/mla_absorbed_or_expanded.py [--prefixes 2048,16384,65536]
        [--new 16,32,64,128,256,512] [--heads 16,64]

Prints a table and writes mla_absorbed_or_expanded-<GPU>-<date>.json to $OUT (or
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import median_ms  # noqa: E402
from result_names import result_path  # noqa: E402

from ember.attention import mla  # noqa: E402
from ember.attention.metadata import AttentionMetadata  # noqa: E402

RANK, ROPE, NOPE, V, BLOCK = 512, 64, 128, 128, 64


def case(heads: int, prefix: int, new: int) -> dict:
    dt, dev = torch.bfloat16, "cuda"
    total = prefix + new
    nblocks = -(-total // BLOCK)
    cache = torch.randn(nblocks, 1, BLOCK, 1, RANK + ROPE, dtype=dt, device=dev)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, new], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([total], dtype=torch.int32, device=dev),
        block_tables=torch.arange(nblocks, dtype=torch.int32, device=dev).unsqueeze(0),
        slot_mapping=torch.arange(prefix, total, dtype=torch.int64, device=dev),
        max_query_len=new,
        max_seq_len=total,
        query_start_loc_cpu=[0, new],
        seq_lens_cpu=[total],
    )
    q_nope = torch.randn(new, heads, NOPE, dtype=dt, device=dev)
    q_rope = torch.randn(new, heads, ROPE, dtype=dt, device=dev)
    latent = torch.randn(new, RANK + ROPE, dtype=dt, device=dev)
    w_uk = torch.randn(heads, NOPE, RANK, dtype=dt, device=dev) * RANK**-0.5
    w_uv = torch.randn(heads, V, RANK, dtype=dt, device=dev) * RANK**-0.5
    scale = (NOPE + ROPE) ** -0.5
    saved = mla.EXPAND_MIN_QUERY
    times = {}
    try:
        for way, threshold in (("absorbed", 1 << 30), ("expanded", 1)):
            mla.EXPAND_MIN_QUERY = threshold
            times[way] = median_ms(
                lambda: mla.mla_attention(q_nope, q_rope, latent, w_uk, w_uv, cache, md, scale),
                iters=10,
            )
    finally:
        mla.EXPAND_MIN_QUERY = saved
    return {
        "heads": heads,
        "prefix": prefix,
        "new": new,
        "absorbed_ms": round(times["absorbed"], 3),
        "expanded_ms": round(times["expanded"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefixes", default="2048,16384,65536")
    ap.add_argument("--new", default="16,32,64,128,256,512")
    ap.add_argument("--heads", default="16,64")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name(0)
    rows = [
        case(h, p, n)
        for h in (int(x) for x in args.heads.split(","))
        for p in (int(x) for x in args.prefixes.split(","))
        for n in (int(x) for x in args.new.split(","))
    ]
    print(f"## MLA prefill over a cached prefix: absorbed or expanded, bf16, {gpu}")
    print("| heads | prefix | new | absorbed ms | expanded ms | faster |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        best = "absorbed" if r["absorbed_ms"] < r["expanded_ms"] else "expanded"
        print(
            f"| {r['heads']} | {r['prefix']} | {r['new']} | {r['absorbed_ms']} "
            f"| {r['expanded_ms']} | {best} |"
        )
    path = result_path("mla_absorbed_or_expanded", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
