"""The decode phase's matmuls (M = 128-256 rows of the 8B shape) run other ways than ember runs
them, against `torch.mm(a, w.t())` (cuBLAS on nn.Linear's [N, K] weight) in the same run:

- `nn`: the weight stored transposed ([K, N], contiguous): cuBLAS's other operand layout;
- `swap`: the transposed product w @ a^T into an [N, M] output: cuBLAS sees the small dimension on
  the other side and its heuristics pick other kernels;
- `inductor`: `torch.compile(mode="max-autotune-no-cudagraphs")`, which times its Triton GEMM
  templates (persistent TMA ones included) against cuBLAS and keeps the fastest; timed here with
  the copy of its output into the step's buffer (its autotune table, printed to stderr, times
  single calls without the copy).

Each time is a CUDA-graph replay over rotating weight copies (as `gemm_shapes.py`), against the
floor of the same run (FLOPs over the matmul peak, bytes over the copy ceiling).

    python benchmarks/probes/gemm_variants.py [--m 256,128]

Prints a table and writes $OUT/gemm_variants-<GPU>.json (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import ceilings  # noqa: E402
from gemm_shapes import WEIGHTS, graph_us, rel_err  # noqa: E402

LABELS = ("nt", "nn", "swap", "inductor")


def mm_nt(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> None:
    torch.mm(a, w.t(), out=c)


def mm_nn(a: torch.Tensor, wt: torch.Tensor, c: torch.Tensor) -> None:
    torch.mm(a, wt, out=c)


def mm_swap(a: torch.Tensor, w: torch.Tensor, ct: torch.Tensor) -> None:
    torch.mm(w, a.t(), out=ct)


def measure(name: str, m: int, peak: float, bw: float, compiled) -> dict:
    n, k = WEIGHTS[name]
    copies = max(2, min(8, -(-(256 << 20) // (n * k * 2))))  # > 200 MB of weights a replay
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    wts = [w.t().contiguous() for w in ws]
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    cs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    cts = [torch.empty(n, m, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    flops = 2 * m * n * k
    floor_us = max(flops / peak, (n * k + m * k + m * n) * 2 / bw) * 1e6
    ref = a.float() @ ws[0].float().t()
    row: dict = {"weight": name, "m": m, "floor_us": floor_us}
    t0 = time.perf_counter()
    row["inductor_err"] = rel_err(compiled(a, ws[0]), ref)
    row["inductor_compile_s"] = time.perf_counter() - t0

    def inductor(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> None:
        c.copy_(compiled(a, w))

    mm_swap(a, ws[0], cts[0])
    row["swap_err"] = rel_err(cts[0].t(), ref)
    mm_nn(a, wts[0], cs[0])
    row["nn_err"] = rel_err(cs[0], ref)
    plain = list(zip([a] * copies, ws, cs, strict=True))
    # torch.mm first and last: a clock that drifts over the shape's runs favours neither.
    variants = [
        ("nt", mm_nt, plain),
        ("nn", mm_nn, list(zip([a] * copies, wts, cs, strict=True))),
        ("swap", mm_swap, list(zip([a] * copies, ws, cts, strict=True))),
        ("inductor", inductor, plain),
        ("nt", mm_nt, plain),
    ]
    for label, fn, calls in variants:
        row[label] = min(row.get(label, float("inf")), graph_us(fn, calls))
    for label in LABELS:
        row[f"{label}_of_floor"] = floor_us / row[label]
    del ws, wts, cs, cts
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="256,128")
    args = ap.parse_args()
    inductor_config.max_autotune_gemm_backends = "TRITON,ATEN"
    inductor_config.triton.enable_persistent_tma_matmul = True
    compiled = torch.compile(
        lambda a, w: a @ w.t(), mode="max-autotune-no-cudagraphs", dynamic=False
    )
    gpu = torch.cuda.get_device_name()
    ceil = ceilings()
    peak, bw = ceil["matmul_flops"], ceil["copy_bytes_per_s"]
    rows = []
    for m in (int(x) for x in args.m.split(",")):
        for name in WEIGHTS:
            rows.append(measure(name, m, peak, bw, compiled))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{gpu}: copy {bw / 1e9:,.0f} GB/s, matmul peak {peak / 1e12:,.0f} TFLOP/s")
    print("| weight | M | floor us | " + " | ".join(f"{x} us (of floor)" for x in LABELS) + " |")
    print("|---|---|---|" + "---|" * len(LABELS))
    for r in rows:
        cells = [f"{r[x]:,.1f} ({r[f'{x}_of_floor']:.2f})" for x in LABELS]
        print(f"| {r['weight']} | {r['m']} | {r['floor_us']:,.1f} | " + " | ".join(cells) + " |")
    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "results"))
    out = out_dir / f"gemm_variants-{gpu.replace(' ', '_')}.json"
    out.write_text(json.dumps({"gpu": gpu, "ceilings": ceil, "rows": rows}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
