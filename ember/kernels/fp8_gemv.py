"""FP8 (e4m3) weights times a few rows on the CUDA cores (Triton): decode's block-FP8 GEMV.

fp8_gemm.py's GEMM puts a decode row in a 16-row tensor-core tile: 15 rows masked, and in W8A8
each column tile redoes the row's work around the dot. At one row the weights' bytes are all the
time there is (DeepSeek-V3's and Kimi K2's layers read ~0.5 GB of fp8 a token), so here each
program owns BLOCK_N weight rows and walks K on the CUDA cores, as int_gemm.py's CUDA-core GEMV
does for packed INT:

- A thread loads 16 bytes of each of its BLOCK_N rows a step (one 16-byte load a row, the lanes
  and warps along K); the hardware converts e4m3 to fp32 (exact: every e4m3 value is an fp32
  value), and the 16 products with x meet in one FFMA chain in the thread.
- x is the reference's: in W8A8 (`act_group` > 0) the row quantized per group
  (fp8_gemm.quantize_fp8_groups, one launch before), its codes converted as the weights' are, so
  every product of two e4m3 values is exact in fp32; weight-only, x as it is in fp32.
- A chunk's 16 products lie in one weight block and one activation group (their widths along K
  are multiples of 16, or all of K), so its sum is scaled once, by the product of the two scales;
  a scale that is the same along all of K is applied once at the end. The result is the exact
  product's sum in fp32 in another order than fp8_gemm's: the same contract as the GEMM (equal
  to quant_ref.fp8_matmul_ref up to the order of fp32 sums).
- A branch on M (no specialization) runs a loop of 1, 2 or 4 rows of x, so one row pays for no
  other's multiply-adds, and each weight is converted once for every row.

`_core_loop` is shared with the FP8 experts' decode path (fused_moe_decode.py), which runs it a
(token, expert) pair a program. Everything is fixed-shape with no host sync: captured in CUDA
graphs; M does not specialize, so one variant per weight shape serves 1..CORE_MAX_ROWS rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.int_gemm import _core_store, _sum_splits_kernel

CORE_MAX_ROWS = 4
"""Up to this many rows take the CUDA-core GEMV; more take fp8_gemm's tensor-core tiles."""
CHUNK = tl.constexpr(16)
"""e4m3 values of a weight row a thread loads and sums a step: one 16-byte load."""


@triton.jit
def _core_x(
    x_ptr,
    xs_ptr,
    row,
    k0,
    K,
    stride_xm,
    stride_xk,
    stride_xsm,
    U: tl.constexpr,
    X_GROUP: tl.constexpr,
    X_STEP: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Row `row` of x at a step, fp32 [U, CHUNK] (zeros past K): chunk u holds the values at
    k0 + CHUNK * u onward, the ones thread u multiplies. And (X_STEP) each chunk's activation
    scale [U, 1]; otherwise a placeholder 1."""
    u = tl.arange(0, U)
    i = tl.arange(0, CHUNK)
    k = k0 + CHUNK * u[:, None] + i[None, :]
    ptrs = x_ptr + row * stride_xm + k * stride_xk  # row < CORE_MAX_ROWS: no int32 overflow
    x = tl.load(ptrs) if EVEN else tl.load(ptrs, mask=k < K, other=0.0)
    xs = tl.full((U, 1), 1.0, tl.float32)
    if X_STEP:
        g = (k0 + CHUNK * u) // X_GROUP
        if not EVEN:
            g = tl.minimum(g, (K - 1) // X_GROUP)  # chunks past K: any group in bounds
        xs = tl.load(xs_ptr + row * stride_xsm + g)[:, None]
    return x.to(tl.float32), xs


@triton.jit
def _core_row(
    acc,
    w,
    ws,
    x_ptr,
    xs_ptr,
    row,
    k0,
    K,
    stride_xm,
    stride_xk,
    stride_xsm,
    X_GROUP: tl.constexpr,
    X_STEP: tl.constexpr,
    W_STEP: tl.constexpr,
    EVEN: tl.constexpr,
):
    """acc [U, BLOCK_N] plus each chunk's 16 products with row `row` of x, scaled by the chunk's
    weight scale (W_STEP) and activation scale (X_STEP)."""
    U: tl.constexpr = w.shape[0]
    x, xs = _core_x(
        x_ptr, xs_ptr, row, k0, K, stride_xm, stride_xk, stride_xsm, U, X_GROUP, X_STEP, EVEN
    )
    d = tl.sum(w * x[:, None, :], axis=2)
    if W_STEP and X_STEP:
        return acc + d * (ws * xs)
    elif W_STEP:
        return acc + d * ws
    elif X_STEP:
        return acc + d * xs
    return acc + d


@triton.jit
def _core_loop(
    x_ptr,
    xs_ptr,
    w_rows,
    ws_rows,
    r0,
    r1,
    r2,
    r3,
    k_begin,
    k_end,
    K,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_wk,
    stride_wsk,
    ROWS: tl.constexpr,
    X_GROUP: tl.constexpr,
    X_STEP: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    W_STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr,
):
    """W[rows, k_begin:k_end] @ x[r].T for the first ROWS of x's rows r0..r3: four [BLOCK_N]
    fp32 sums, the unused ones 0. w_rows: pointers [1, BLOCK_N, 1] to the weight rows' first
    values; ws_rows: [1, BLOCK_N] to their scale rows' first scales. Scales that do not change
    along K (W_STEP / X_STEP off) are the caller's to apply."""
    U: tl.constexpr = BLOCK_K // CHUNK
    u = tl.arange(0, U)
    i = tl.arange(0, CHUNK)
    acc0 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    # An explicit num_stages: Triton pipelines a loop's loads (cp.async into shared memory)
    # without a tl.dot in it only when the loop asks.
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        k = k0 + CHUNK * u[:, None, None] + i[None, None, :]
        if EVEN:
            w = tl.load(w_rows + k * stride_wk)
        else:
            w = tl.load(w_rows + k * stride_wk, mask=k < K, other=0.0)
        w = w.to(tl.float32)  # exact: every e4m3 value is an fp32 value
        ws = tl.zeros((1, BLOCK_N), dtype=tl.float32)  # not read (W_STEP off)
        if W_STEP:
            # A chunk lies in one block along K (its width is a multiple of CHUNK).
            g = (k0 + CHUNK * u) // W_BLOCK_K
            if not EVEN:
                g = tl.minimum(g, (K - 1) // W_BLOCK_K)
            ws = tl.load(ws_rows + g[:, None] * stride_wsk)
        acc0 = _core_row(
            acc0, w, ws, x_ptr, xs_ptr, r0, k0, K, stride_xm, stride_xk, stride_xsm, X_GROUP,
            X_STEP, W_STEP, EVEN,
        )  # fmt: skip
        if ROWS > 1:
            acc1 = _core_row(
                acc1, w, ws, x_ptr, xs_ptr, r1, k0, K, stride_xm, stride_xk, stride_xsm,
                X_GROUP, X_STEP, W_STEP, EVEN,
            )  # fmt: skip
        if ROWS > 2:
            acc2 = _core_row(
                acc2, w, ws, x_ptr, xs_ptr, r2, k0, K, stride_xm, stride_xk, stride_xsm,
                X_GROUP, X_STEP, W_STEP, EVEN,
            )  # fmt: skip
            acc3 = _core_row(
                acc3, w, ws, x_ptr, xs_ptr, r3, k0, K, stride_xm, stride_xk, stride_xsm,
                X_GROUP, X_STEP, W_STEP, EVEN,
            )  # fmt: skip
    return tl.sum(acc0, axis=0), tl.sum(acc1, axis=0), tl.sum(acc2, axis=0), tl.sum(acc3, axis=0)


@triton.jit
def _end_scale(y, xs_ptr, row, stride_xsm, ws, X_ONCE: tl.constexpr, W_ONCE: tl.constexpr):
    """A row's sums times the scales that hold for all of K: its activation scale (X_ONCE) and
    the weight rows' (W_ONCE, `ws` [BLOCK_N])."""
    if X_ONCE:
        y = y * tl.load(xs_ptr + row * stride_xsm)
    if W_ONCE:
        y = y * ws
    return y


# M must not specialize: one variant serves 1..CORE_MAX_ROWS rows, each count taking its branch.
@triton.jit(do_not_specialize=["M"])
def _core_gemv_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    M,
    N,
    K,
    k_split,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    X_GROUP: tl.constexpr,
    X_STEP: tl.constexpr,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    W_STEP: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # Program (n, s): columns [n * BLOCK_N, +BLOCK_N) over split s's range of K. X_GROUP: the
    # activation group (0: weight-only, x as it is); X_STEP / W_STEP: that scale changes along K.
    pid_k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N read row N - 1 (in bounds, so the loads need no row mask) and are not stored.
    rows_w = tl.minimum(cols, N - 1).to(tl.int64)
    w_rows = w_ptr + rows_w[None, :, None] * stride_wn
    ws_rows = ws_ptr + (rows_w // W_BLOCK_N)[None, :] * stride_wsn
    k_begin = pid_k * k_split
    k_end = tl.minimum(k_begin + k_split, K)
    r1 = tl.minimum(M - 1, 1)
    r2 = tl.minimum(M - 1, 2)
    r3 = tl.minimum(M - 1, 3)
    if M == 1:
        y0, y1, y2, y3 = _core_loop(
            x_ptr, xs_ptr, w_rows, ws_rows, 0, r1, r2, r3, k_begin, k_end, K, stride_xm,
            stride_xk, stride_xsm, stride_wk, stride_wsk, 1, X_GROUP, X_STEP, W_BLOCK_K,
            W_STEP, BLOCK_N, BLOCK_K, EVEN, STAGES,
        )  # fmt: skip
    elif M == 2:
        y0, y1, y2, y3 = _core_loop(
            x_ptr, xs_ptr, w_rows, ws_rows, 0, r1, r2, r3, k_begin, k_end, K, stride_xm,
            stride_xk, stride_xsm, stride_wk, stride_wsk, 2, X_GROUP, X_STEP, W_BLOCK_K,
            W_STEP, BLOCK_N, BLOCK_K, EVEN, STAGES,
        )  # fmt: skip
    else:
        y0, y1, y2, y3 = _core_loop(
            x_ptr, xs_ptr, w_rows, ws_rows, 0, r1, r2, r3, k_begin, k_end, K, stride_xm,
            stride_xk, stride_xsm, stride_wk, stride_wsk, 4, X_GROUP, X_STEP, W_BLOCK_K,
            W_STEP, BLOCK_N, BLOCK_K, EVEN, STAGES,
        )  # fmt: skip
    X_ONCE: tl.constexpr = X_GROUP > 0 and not X_STEP
    W_ONCE: tl.constexpr = not W_STEP
    ws = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if W_ONCE:
        ws = tl.load(ws_ptr + (rows_w // W_BLOCK_N) * stride_wsn)
    y0 = _end_scale(y0, xs_ptr, 0, stride_xsm, ws, X_ONCE, W_ONCE)
    y1 = _end_scale(y1, xs_ptr, r1, stride_xsm, ws, X_ONCE, W_ONCE)
    y2 = _end_scale(y2, xs_ptr, r2, stride_xsm, ws, X_ONCE, W_ONCE)
    y3 = _end_scale(y3, xs_ptr, r3, stride_xsm, ws, X_ONCE, W_ONCE)
    _core_store(y_ptr, y0, 0, cols, M, N, pid_k, PARTIAL)
    _core_store(y_ptr, y1, 1, cols, M, N, pid_k, PARTIAL)
    _core_store(y_ptr, y2, 2, cols, M, N, pid_k, PARTIAL)
    _core_store(y_ptr, y3, 3, cols, M, N, pid_k, PARTIAL)


def core_gemv_config(n: int, k: int) -> dict[str, int]:
    """The CUDA-core FP8 GEMV's tiles for a weight of [n, k] (tunables), as swept on an H200
    (benchmarks/probes/fp8_decode_sweep.py, Kimi K2's eight projections at one row, two at four
    rows; fp8_decode_sweep-H200-2026-12-02.json): within 4% of each shape's best.

    - BLOCK_N 4 (4 rows x 16 bytes a thread a step): 8 rows were no faster at any shape.
    - Threads by the column tiles: few tiles (q_a's 1,536 rows, kv_a's 576: fewer than 512)
      take 4 warps and 4,096 of K a step (7.7 and 6.2 us against 10.7 and 8.0 at 8 x 1024 over
      2 warps); up to 1,536 tiles 2 warps and one 16-byte chunk a thread (1,024); more, one warp
      and two chunks a thread (1,024), or 512 where that does not divide K (q_b's 1,536).
    - One stage and no split: a second stage or a split of K was slower at every shape.
    """
    block_n = 4
    tiles = triton.cdiv(n, block_n)
    if tiles < 512:
        warps, block_k = 4, 4096
    elif tiles < 1536:
        warps, block_k = 2, 1024
    else:
        warps, block_k = 1, 1024 if k % 1024 == 0 or k % 512 else 512
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, num_warps=warps, num_stages=1)


def fits_core(k: int, block: tuple[int, int], act_group: int) -> bool:
    """Whether a chunk of CHUNK values lies in one weight block and one activation group: their
    widths along K are multiples of CHUNK, or all of K."""
    return all(w >= k or w % CHUNK.value == 0 for w in (block[1], act_group) if w)


def fp8_core_gemv(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    act_group: int,
    out_dtype: torch.dtype,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """a [M, K] (M <= CORE_MAX_ROWS) @ W.T for W = float8_e4m3fn weight [N, K] with float32
    scale [ceil(N / bn), ceil(K / bk)]: a is x itself (act_group 0) or its e4m3 codes with
    a_scale [M, ceil(K / act_group)] (fp8_gemm.quantize_fp8_groups). fp8_gemm.fp8_matmul checks
    the shapes and calls this; `fits_core` must hold. Returns [M, N] in out_dtype."""
    m, k = a.shape
    n = weight.shape[0]
    bn, bk = block
    if m > CORE_MAX_ROWS:
        raise ValueError(f"fp8_core_gemv: {m} rows, more than CORE_MAX_ROWS ({CORE_MAX_ROWS})")
    if not fits_core(k, block, act_group):
        raise ValueError(
            f"fp8_core_gemv: block {block} and act_group {act_group} must be multiples of "
            f"{CHUNK.value} along K (or cover K={k})"
        )
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    config = dict(config or core_gemv_config(n, k))
    block_k = config["BLOCK_K"]
    if block_k & (block_k - 1) or block_k < CHUNK.value:
        raise ValueError(f"fp8_core_gemv: BLOCK_K {block_k} must be a power of two >= 16")
    steps = triton.cdiv(k, block_k)
    k_split = triton.cdiv(steps, config.pop("SPLIT_K", 1)) * block_k
    splits = triton.cdiv(k, k_split)  # no split left empty
    out = torch.empty(splits, m, n, dtype=torch.float32, device=a.device) if splits > 1 else y
    xs = a_scale if a_scale is not None else scale  # never read when act_group is 0
    _core_gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]), splits)](
        a, xs, weight, scale, out, m, n, k, k_split, *a.stride(), xs.stride(0),
        *weight.stride(), *scale.stride(),
        X_GROUP=act_group, X_STEP=0 < act_group < k, W_BLOCK_N=bn, W_BLOCK_K=bk,
        W_STEP=bk < k, PARTIAL=splits > 1, EVEN=k % block_k == 0,
        STAGES=config.pop("num_stages"), **config,
    )  # fmt: skip
    if splits > 1:
        width = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, width),)](out, y, m * n, SPLITS=splits, BLOCK=width)
    return y
