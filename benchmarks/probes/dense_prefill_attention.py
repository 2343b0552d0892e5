"""A dense model's fresh-prompt attention (causal, GQA) at the Llama-3.1-8B shape (32 query
heads, 8 KV heads of 128, bf16) by prompt length: ember's Triton prefill kernel (the TMA kernel
on Hopper, as the engine runs it) against torch's fused attention through cuDNN and through
FlashAttention-2, each checked against the first and timed per call, against the bf16 matmul
peak of the same run. What the 8B shape's fresh 16k prompt (about 229 TFLOP of matmuls and 70
of attention) could gain from a faster attention kernel.

    python benchmarks/probes/dense_prefill_attention.py [--lengths 2048,8192,16384,32768]

Prints a table and writes dense_prefill_attention-<GPU>-<date>.json to $OUT (or
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import matmul_flops, median_ms  # noqa: E402
from result_names import result_path  # noqa: E402

from ember.kernels.prefill_attention import prefill_attention  # noqa: E402

HQ, HKV, D = 32, 8, 128


def case(n: int, peak: float) -> dict:
    dt = torch.bfloat16
    q = torch.randn(n, HQ, D, dtype=dt, device="cuda")
    k = torch.randn(n, HKV, D, dtype=dt, device="cuda")
    v = torch.randn(n, HKV, D, dtype=dt, device="cuda")
    cache = torch.zeros(4, 2, 64, HKV, D, dtype=dt, device="cuda")
    qsl = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    scale = D**-0.5

    def triton() -> torch.Tensor:
        return prefill_attention(q, cache, qsl, lens, table, scale, n, k=k, v=v)

    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    kx = kt.repeat_interleave(HQ // HKV, dim=1)
    vx = vt.repeat_interleave(HQ // HKV, dim=1)

    def sdpa(backend: SDPBackend, gqa: bool) -> torch.Tensor:
        with sdpa_kernel([backend]):
            if gqa:
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qt, kx, vx, is_causal=True)
        return o[0].transpose(0, 1)

    ways = {
        "triton": triton,
        "cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, False),
        "cudnn_gqa": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, True),
        "flash_gqa": lambda: sdpa(SDPBackend.FLASH_ATTENTION, True),
    }
    flops = 4 * n * (n + 1) / 2 * HQ * D
    want = triton().float()
    row: dict = {"tokens": n}
    for name, fn in ways.items():
        try:
            err = ((fn().float() - want).norm() / want.norm()).item()
            ms = median_ms(fn, iters=10)
        except Exception as e:  # (a backend that does not take this call)
            row[name] = {"error": str(e)[:100]}
            continue
        tf = flops / (ms / 1e3)
        row[name] = {
            "ms": round(ms, 3),
            "tflops": round(tf / 1e12, 1),
            "of_peak": round(tf / peak, 3),
            "rel_err": round(err, 4),
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,8192,16384,32768")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name(0)
    peak = matmul_flops()
    rows = [case(int(n), peak) for n in args.lengths.split(",")]
    names = ("triton", "cudnn", "cudnn_gqa", "flash_gqa")
    print(f"## dense fresh-prompt attention, 8B shape, bf16, {gpu}, peak {peak / 1e12:.0f} TFLOP/s")
    print("| tokens | " + " | ".join(f"{n} ms (of peak)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for r in rows:
        cells = []
        for n in names:
            c = r[n]
            cells.append(c["error"][:40] if "error" in c else f"{c['ms']} ({c['of_peak']})")
        print(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    path = result_path("dense_prefill_attention", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"gpu": gpu, "matmul_peak_tflops": round(peak / 1e12, 1), "rows": rows}
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
