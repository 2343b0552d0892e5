"""Which of torch's fused attention kernels MLA's expanded prefill should take for a fresh prompt
(causal, q/k head 192, v head 128, bf16), by length and head count: the memory-efficient kernel
(no per-shape set-up) against cuDNN's (a plan built for every new shape, then the faster kernel),
timed per call, with cuDNN's first call at each length (its plan) apart.

    python benchmarks/probes/mla_attention_backends.py [--lengths 256,...] [--heads 16,64]

Prints a table and writes mla_attention_backends-<GPU>-<date>.json to $OUT (or
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import median_ms  # noqa: E402
from result_names import result_path  # noqa: E402


def time_length(heads: int, n: int) -> dict:
    q = torch.randn(1, heads, n, 192, dtype=torch.bfloat16, device="cuda")
    k = torch.randn_like(q)
    v = torch.randn(1, heads, n, 128, dtype=torch.bfloat16, device="cuda")

    def call(backend: SDPBackend) -> None:
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call(SDPBackend.CUDNN_ATTENTION)
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    cudnn = median_ms(lambda: call(SDPBackend.CUDNN_ATTENTION))
    efficient = median_ms(lambda: call(SDPBackend.EFFICIENT_ATTENTION))
    return {
        "heads": heads,
        "tokens": n,
        "efficient_ms": round(efficient, 3),
        "cudnn_ms": round(cudnn, 3),
        "cudnn_first_call_ms": round(first, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,512,1024,2048,3072,4096,6144,8192")
    ap.add_argument("--heads", default="16,64")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name(0)
    rows = [
        time_length(heads, n)
        for heads in (int(h) for h in args.heads.split(","))
        for n in (int(x) for x in args.lengths.split(","))
    ]
    print(f"## MLA expanded attention, fresh causal prompt, bf16, {gpu}")
    print("| heads | tokens | efficient ms | cuDNN ms | cuDNN first call ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['heads']} | {r['tokens']} | {r['efficient_ms']} | {r['cudnn_ms']} "
            f"| {r['cudnn_first_call_ms']} |"
        )
    path = result_path("mla_attention_backends", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
