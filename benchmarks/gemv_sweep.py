"""The sweep behind ember/kernels/gemv.py (session 12): a probe GEMV for M = 1, 2, 4, 8 rows (a row
dimension, the sizes specialized; it differs from the landed kernel there) over block widths,
K runs, warps and stages, against cuBLAS (F.linear), each weight of the 8B shape, inside CUDA
graphs over weights larger than L2. Prints each shape's best config; writes gemv_probe.json to
$OUT (or /tmp). `benchmarks/gemv.py` measures the landed kernel."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_gpu import copy_bandwidth  # noqa: E402
from gemv import SHAPES, graph_us  # noqa: E402


@triton.jit
def _gemv(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + kk[None, :], mask=n[:, None] < N, other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m[:, None] < M, other=0.0)
        acc += tl.sum(
            tl.expand_dims(x.to(tl.float32), 1) * tl.expand_dims(w.to(tl.float32), 0), axis=2
        )
    tl.store(
        y_ptr + m[:, None] * stride_ym + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(m[:, None] < M) & (n[None, :] < N),
    )


def gemv(x, w, bn, bk, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(N, bn),)](
        x,
        w,
        y,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=max(1, triton.next_power_of_2(M)),
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return y


CONFIGS = [
    (bn, bk, warps, stages)
    for bn in (4, 8, 16)
    for bk in (256, 512, 1024)
    for warps in (4, 8)
    for stages in (3, 4)
]


def one(n: int, k: int, m: int) -> dict:
    """cuBLAS and every config of the probe at m rows of one weight shape."""
    copies = max(2, int(200e6 // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    ref = F.linear(x, ws[0])
    turn = [0]

    def weight() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % copies
        return ws[turn[0]]

    r: dict = {"cublas_us": graph_us(lambda: F.linear(x, weight()))}
    best = None
    for cfg in CONFIGS:
        if m * cfg[0] * cfg[1] > 32768:  # the [M, BLOCK_N, BLOCK_K] product spills
            continue
        name = ",".join(map(str, cfg))
        try:
            err = (gemv(x, ws[0], *cfg).float() - ref.float()).abs().max().item()
            if err > 0.05:
                r[name] = f"wrong {err}"
                continue
            r[name] = graph_us(lambda cfg=cfg: gemv(x, weight(), *cfg))
        except Exception as e:  # a config that does not fit
            r[name] = f"failed {type(e).__name__}"
            continue
        if best is None or r[name] < best[0]:
            best = (r[name], name)
    r["best"] = best
    return r


def main() -> None:
    bw = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": bw, "rows": {}}
    print(out["gpu"], f"copy {bw / 1e9:.0f} GB/s")
    for name, (n, k, _) in SHAPES.items():
        floor = n * k * 2 / bw * 1e6
        for m in (1, 2, 4, 8):
            r = one(n, k, m)
            r["floor_us"] = floor
            out["rows"][f"{name} M={m}"] = r
            print(
                f"{name:8s} M={m}: floor {floor:6.1f} us  cuBLAS {r['cublas_us']:6.1f}  "
                f"probe best {r['best'][0]:6.1f} ({r['best'][1]})"
            )
    dest = Path(os.environ.get("OUT") or "/tmp")
    (dest / "gemv_probe.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
