"""The Llama-3-8B shape's matmuls alone: is cuBLAS at the card's ceilings on the shapes ember runs?

For each weight of a layer (qkv, o, gate_up, down; x @ W^T with W of nn.Linear's [N, K] layout)
and each row count M of a step (batch-1 decode to a 16,384-token prefill step), the time of:

- cuBLAS (torch.mm, torch's default BLAS library) and cuBLASLt (`preferred_blas_library`), each
  twice in turn, the better time of each kept;
- a plain Triton GEMM and a Triton GEMM over TMA descriptors, each tile config listed below tried,
  checked against torch.mm in fp32 first (relative error < 1e-2, bf16 operands);

each against its floor in the same run: the larger of FLOPs over the matmul peak (8192^3 by
cuBLAS) and bytes (weights + activations once) over the copy ceiling. Times are CUDA-graph replays
over rotating weight copies (no L2 reuse between calls). A last table runs the prefill shape
back to back for ~3 s: a clock that falls under sustained load shows as a rate below the burst's.

    python benchmarks/probes/gemm_shapes.py [--m 1,64,128,256,512,2048,16384]

Prints tables and writes $OUT/gemm_shapes-<GPU>.json (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import ceilings, graph_ms  # noqa: E402

# name: (N, K) of the 8B shape (hidden 4096, 32 heads / 8 KV heads of 128, intermediate 14336).
WEIGHTS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
CONFIGS = [
    (64, 128, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 64, 128, 4, 4),
    (128, 128, 128, 8, 2),
]


@triton.jit
def _gemm(
    a_ptr, w_ptr, c_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """C[M, N] = A[M, K] @ W[N, K]^T, row-major, bf16 in and out, fp32 accumulation."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP * grid_n)
    first_m = group * GROUP
    size_m = min(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % (GROUP * grid_n)) % size_m
    pid_n = (pid % (GROUP * grid_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None] * K + rk[None, :]
    w = w_ptr + rn[:, None] * K + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(0, K, BLOCK_K):
        x = tl.load(a, mask=rm[:, None] < M, other=0.0)
        y = tl.load(w, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(y), acc)
        a += BLOCK_K
        w += BLOCK_K
    c = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c, acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gemm_tma(
    a_desc, w_desc, c_desc, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """As _gemm, with the tiles moved by TMA (host-built tensor descriptors)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP * grid_n)
    first_m = group * GROUP
    size_m = min(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % (GROUP * grid_n)) % size_m
    pid_n = (pid % (GROUP * grid_n)) // size_m
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = a_desc.load([pid_m * BLOCK_M, k])
        y = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(x, y.T, acc)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))


def triton_mm(kind: str, cfg: tuple[int, ...]):
    bm, bn, bk, warps, stages = cfg

    def run(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> None:
        m, k = a.shape
        n = w.shape[0]
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        if kind == "triton":
            _gemm[grid](a, w, c, m, n, k, bm, bn, bk, 8, num_warps=warps, num_stages=stages)
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor

            _gemm_tma[grid](
                TensorDescriptor.from_tensor(a, [bm, bk]),
                TensorDescriptor.from_tensor(w, [bn, bk]),
                TensorDescriptor.from_tensor(c, [bm, bn]),
                m, n, k, bm, bn, bk, 8, stages, num_warps=warps,
            )  # fmt: skip

    return run


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def graph_us(fn, calls: list, reps: int = 20) -> float:
    """Mean GPU microseconds of one call, replaying a graph that makes each call in `calls` once
    (rotating weights, so no call finds the previous one's weights in L2)."""

    def all_calls() -> None:
        for args in calls:
            fn(*args)

    return graph_ms(all_calls, iters=reps) * 1e3 / len(calls)


def torch_mm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> None:
    torch.mm(a, w.t(), out=c)


SPLIT_K = (2, 4)


def split_k_mm(parts: int):
    def run(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> None:
        m, k = a.shape
        n, h = w.shape[0], k // parts
        a3 = a.view(m, parts, h).transpose(0, 1)  # [parts, m, h]
        w3 = w.view(n, parts, h).permute(1, 2, 0)  # [parts, h, n], K-major
        c.copy_(torch.bmm(a3, w3, out_dtype=torch.float32).sum(0))

    return run


def measure_shape(name: str, m: int, peak: float, bw: float, kinds: list[str]) -> dict:
    n, k = WEIGHTS[name]
    copies = max(2, min(8, -(-(256 << 20) // (n * k * 2))))  # > 200 MB of weights a replay
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    cs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    calls = list(zip([a] * copies, ws, cs, strict=True))
    flops = 2 * m * n * k
    floor_s = max(flops / peak, (n * k + m * k + m * n) * 2 / bw)
    ref = a.float() @ ws[0].float().t()
    row: dict = {"weight": name, "m": m, "n": n, "k": k, "floor_us": floor_s * 1e6}

    def record(label: str, us: float, extra: dict | None = None) -> None:
        row[label] = {
            "us": us,
            "tflops": flops / us / 1e6,
            "of_floor": floor_s * 1e6 / us,
            **(extra or {}),
        }

    # Each library twice, alternating, the better of each pair kept: a clock that drifts over
    # the run (the card heats) favours neither.
    best: dict[str, float] = {}
    for lib in ("cublas", "cublaslt", "cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(lib)
        best[lib] = min(best.get(lib, float("inf")), graph_us(torch_mm, calls))
    for lib, us in best.items():
        record(lib, us)
    torch.backends.cuda.preferred_blas_library("cublas")
    for parts in SPLIT_K if m <= 512 else ():
        # cuBLAS on K split in `parts` (one strided batched GEMM into fp32 partials, then their
        # sum): more tiles for the 4,096-wide outputs (o, down), whose 128 x 128 tiles fill half
        # of an H200's 132 SMs at M = 256.
        fn = split_k_mm(parts)
        c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        fn(a, ws[0], c)
        err = rel_err(c, ref)
        if err < 1e-2:
            record(f"splitk{parts}", graph_us(fn, calls), {"rel_err": err})
        else:
            row.setdefault("errors", []).append(f"split-K {parts}: rel err {err:.2e}")
    for kind in kinds:
        top: tuple[float, tuple, float] | None = None
        for cfg in CONFIGS:
            if m < 64 and cfg[0] > 64:
                continue
            fn = triton_mm(kind, cfg)
            try:
                c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                fn(a, ws[0], c)
                err = rel_err(c, ref)
                if not err < 1e-2:
                    row.setdefault("errors", []).append(f"{kind} {cfg}: rel err {err:.2e}")
                    continue
                us = graph_us(fn, calls)
            except Exception as e:  # a config that does not fit the card's shared memory
                row.setdefault("errors", []).append(f"{kind} {cfg}: {type(e).__name__}: {e}"[:200])
                continue
            if top is None or us < top[0]:
                top = (us, cfg, err)
        if top is not None:
            record(kind, top[0], {"config": list(top[1]), "rel_err": top[2]})
    del ws, cs
    torch.cuda.empty_cache()
    return row


def sustained(peak: float, seconds: float = 3.0) -> dict:
    """gate_up at M = 16,384 back to back: the rate of the last second against a short burst's."""
    n, k = WEIGHTS["gate_up"]
    a = torch.randn(16384, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(16384, n, dtype=torch.bfloat16, device="cuda")
    flops = 2 * 16384 * n * k
    burst = graph_us(torch_mm, [(a, w, c)] * 3, reps=3)
    t0 = time.perf_counter()
    rates = []
    while time.perf_counter() - t0 < seconds:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            torch_mm(a, w, c)
        e.record()
        e.synchronize()
        rates.append(20 * flops / (s.elapsed_time(e) / 1e3))
    last = rates[-max(1, len(rates) // 3) :]
    return {
        "burst_tflops": flops / burst / 1e6,
        "sustained_tflops": sum(last) / len(last) / 1e12,
        "seconds": seconds,
        "peak_tflops": peak / 1e12,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,64,128,256,512,2048,16384")
    ap.add_argument("--triton", default="triton,tma", help="Triton kernels to try ('' for none)")
    args = ap.parse_args()
    kinds = [k for k in args.triton.split(",") if k]
    ms = [int(x) for x in args.m.split(",")]
    gpu = torch.cuda.get_device_name()
    ceil = ceilings()
    peak, bw = ceil["matmul_flops"], ceil["copy_bytes_per_s"]
    rows = []
    for m in ms:
        for name in WEIGHTS:
            rows.append(measure_shape(name, m, peak, bw, kinds if m >= 64 else []))
            print(json.dumps(rows[-1]), flush=True)
    sus = sustained(peak)
    print(f"\n{gpu}: copy {bw / 1e9:,.0f} GB/s, matmul peak {peak / 1e12:,.0f} TFLOP/s")
    labels = ["cublas", "cublaslt", *(f"splitk{p}" for p in SPLIT_K), *kinds]
    print("| weight | M | floor us | " + " | ".join(f"{x} us (of floor)" for x in labels) + " |")
    print("|---|---|---|" + "---|" * len(labels))
    for r in rows:
        cells = [f"{r[x]['us']:,.1f} ({r[x]['of_floor']:.2f})" if x in r else "-" for x in labels]
        print(f"| {r['weight']} | {r['m']} | {r['floor_us']:,.1f} | " + " | ".join(cells) + " |")
    print(
        f"\nsustained gate_up M=16384: burst {sus['burst_tflops']:.0f} TFLOP/s, last second of "
        f"{sus['seconds']:.0f} s {sus['sustained_tflops']:.0f} TFLOP/s (peak {peak / 1e12:.0f})"
    )
    out_dir = Path(os.environ.get("OUT", Path(__file__).resolve().parents[1] / "results"))
    out = out_dir / f"gemm_shapes-{gpu.replace(' ', '_')}.json"
    out.write_text(json.dumps({"gpu": gpu, "ceilings": ceil, "rows": rows, "sustained": sus}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
