"""Linear layers at decode batch sizes (1 to 16 rows): cuBLAS (F.linear) against the skinny Triton
GEMM, replayed from CUDA graphs, as fractions of the copy bandwidth measured in the same run, over
the projection shapes of Moonlight-16B-A3B, Qwen3-30B-A3B and Llama-3.1-8B, with a sweep of the
kernel's tiles. Prints a table and writes JSON.

    python benchmarks/skinny_gemm.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import ceilings, graph_ms  # noqa: E402

from ember.kernels.skinny_gemm import skinny_linear, tile_config  # noqa: E402

# (name, N, K)
SHAPES = [
    ("moonlight q_proj", 3072, 2048),
    ("moonlight kv_a", 576, 2048),
    ("moonlight o_proj", 2048, 2048),
    ("moonlight shared gate_up", 5632, 2048),
    ("moonlight shared down", 2048, 2816),
    ("moonlight dense down", 2048, 11264),
    ("moonlight lm_head", 163840, 2048),
    ("qwen3-30b qkv", 5120, 2048),
    ("qwen3-30b o_proj", 2048, 4096),
    ("llama-8b qkv", 6144, 4096),
    ("llama-8b gate_up", 28672, 4096),
    ("llama-8b down", 4096, 14336),
]
CANDIDATES = [
    (16, 512, 4, 3),
    (16, 256, 4, 4),
    (32, 256, 4, 3),
    (32, 512, 8, 3),
    (64, 256, 4, 3),
    (64, 128, 4, 4),
    (16, 1024, 4, 3),
]


def main() -> None:
    gpu = torch.cuda.get_device_name()
    ceil = ceilings()
    bw = ceil["copy_bytes_per_s"]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            floor = n * k * 2 / bw * 1e3
            cublas = graph_ms(lambda x=x, w=w: F.linear(x, w))
            default = graph_ms(lambda x=x, w=w: skinny_linear(x, w))
            sweep = {}
            for c in CANDIDATES:
                sweep[str(c)] = graph_ms(lambda x=x, w=w, c=c: skinny_linear(x, w, c))
            best = min(sweep, key=sweep.get)
            rows.append(
                {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "m": m,
                    "floor_ms": floor,
                    "cublas_ms": cublas,
                    "skinny_ms": default,
                    "default": tile_config(n),
                    "best": best,
                    "best_ms": sweep[best],
                    "sweep": sweep,
                }
            )
    out = Path(os.environ.get("OUT") or "benchmarks/results")
    result = {"gpu": gpu, "ceilings": ceil, "rows": rows}
    (out / f"skinny_gemm-{gpu.replace(' ', '_')}.json").write_text(json.dumps(result, indent=2))
    print(f"GPU: {gpu}; copy {bw / 1e9:.0f} GB/s")
    print("| shape | m | floor us | cuBLAS us (bw frac) | skinny us (bw frac) | best config us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f = r["floor_ms"]
        print(
            f"| {r['shape']} | {r['m']} | {f * 1e3:.1f} | {r['cublas_ms'] * 1e3:.1f} "
            f"({f / r['cublas_ms']:.2f}) | {r['skinny_ms'] * 1e3:.1f} ({f / r['skinny_ms']:.2f}) "
            f"| {r['best_ms'] * 1e3:.1f} {r['best']} |"
        )


if __name__ == "__main__":
    main()
