"""FP8 (e4m3) linear layers in Triton: dynamic per-token-group activation quantization, and
y = x @ W.T for a weight stored as float8_e4m3fn with one float32 scale per (bn, bk) block.

Formats and reference math: ember/kernels/quant_ref.py (`quantize_fp8_groups`, `fp8_matmul_ref`).

- **W8A8** (`act_group` > 0): x is quantized as it arrives (`quantize_fp8_groups`, one launch),
  and the fp8 tiles meet in `tl.dot` on the fp8 tensor cores. A K step lies inside one activation
  group and one weight column block, so its dot is scaled once, by a row vector of activation
  scales and a column vector of weight scales, and added to the fp32 accumulator: DeepSeek-V3's
  (128, 128) blocks with 128-wide groups. The dot then restarts from zero every K step, which also
  keeps Hopper's fp8 accumulator (fewer bits than fp32) to one step's sum. A scale that is the
  same along the whole K (channel-wise weights (1, K), per-token activations, act_group K) is
  applied once in the epilogue instead, and the accumulator is promoted every BLOCK_K anyway
  (`max_num_imprecise_acc`): compressed-tensors' FP8_DYNAMIC.
- **Weight-only** (`act_group` == 0): the fp8 tile is converted in registers to x's dtype, exactly
  (every e4m3 value is a bf16, fp16 and fp32 value), and meets x in that dtype's dot; the weight
  scales multiply the fp32 sums, as above. That is the reference's x @ (q * s).T with one rounding
  fewer than dequantizing each weight to x's dtype, and a multiply per output, not per weight.

The two numbers, per matmul: bytes ~= N * K (fp8 weights) + M * K * (itemsize + 1) + M * N *
itemsize; flops = 2 * M * N * K. Decode (M up to a few dozen) is bound by the weights' bytes
(half of bf16's), so small row tiles keep many column tiles, and loads, in flight; prefill is
bound by the fp8 tensor cores (twice bf16's rate on an H200) and takes 128 x 128 tiles.

Everything is fixed-shape kernels with no host sync: captured in CUDA graphs. The batch size does
not specialize a kernel; BLOCK_M is picked from a few fixed configs by M (`tile_config`), so a
start-up that runs one batch of each bucket compiles every variant a layer needs.

Triton handles e4m3 on compute capability 8.9+ only (Ada, Hopper): `supports_fp8` says whether
a device can run these kernels, and `fp8_matmul` raises on one that cannot (a layer there keeps
the weights dequantized; quant_ref.dequantize_fp8). `quantize_fp8_groups` runs everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import capability, dot_precision
from ember.kernels.fp8_gemv import CORE_MAX_ROWS, fits_core, fp8_core_gemv
from ember.kernels.quant_ref import FP8_MAX, FP8_SCALE_EPS

MIN_CAPABILITY = (8, 9)
"""Triton's e4m3 type (loads, casts, fp8 tensor-core dots) needs Ada or newer."""

# Tunables of the quantization kernel (sweep on the GPU): a group of up to QUANT_ONE_PASS
# elements is read once and kept in registers; a longer one (per-token groups of a wide K) is read
# twice in QUANT_CHUNK runs, once for its max and once to quantize. Each program takes about
# QUANT_PROGRAM_ELEMENTS elements (several groups of a row when groups are short).
QUANT_ONE_PASS = 4096
QUANT_CHUNK = 2048
QUANT_PROGRAM_ELEMENTS = 1024

_FP8_MAX = tl.constexpr(FP8_MAX)
_EPS = tl.constexpr(FP8_SCALE_EPS)


def supports_fp8(t: torch.Tensor) -> bool:
    """Whether t's device runs the fp8 GEMM: a CUDA device of compute capability 8.9+, or the CPU
    (Triton's interpreter, for tests)."""
    return not t.is_cuda or capability(t) >= MIN_CAPABILITY


@triton.jit
def _fp8_bits(v, HW_CAST: tl.constexpr):
    """e4m3 bits (uint8) of fp32 v in [-448, 448], rounded to nearest even as torch's cast.

    HW_CAST: the hardware's cast (cvt.rn.satfinite on 8.9+). Otherwise the same rounding in
    integer ops, for devices without it and for Triton 3.6's interpreter, whose cast to fp8 drops
    the carry of a mantissa that rounds up (31.6 became 16, not 32).
    """
    if HW_CAST:
        bits = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        u = v.to(tl.uint32, bitcast=True)
        sign = (u >> 24) & 0x80
        mag = u & 0x7FFFFFFF
        # Normal results: round the 23-bit mantissa to 3 bits (ties to even); a carry runs into
        # the exponent, which is then rebiased from 127 to 7.
        r = mag + 0x7FFFF + ((mag >> 20) & 1)
        normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
        # Below 2**-6 the steps are 2**-9: the value in steps, rounded to an integer (adding and
        # taking away 2**23 rounds to nearest even), is the code itself (8 is 2**-6's).
        steps = mag.to(tl.float32, bitcast=True) * 512.0
        sub = ((steps + 8388608.0) - 8388608.0).to(tl.uint32)
        bits = (tl.where(mag < 0x3C800000, sub, normal) | sign).to(tl.uint8)
    return bits


@triton.jit
def _quantize_tile(x, scale, q_ptrs, mask, HW_CAST: tl.constexpr):
    # The reference's fp32 ops: x / scale correctly rounded (plain `/` is approximate on the GPU).
    v = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    tl.store(q_ptrs, _fp8_bits(v, HW_CAST), mask=mask)


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    # Program (row, j) quantizes groups j * GROUPS ... of one row, a [GROUPS, BLOCK] tile per run.
    # The row is a grid index, not an argument: nothing here depends on the batch size.
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    if CHUNKS == 1:
        cols = groups[:, None] * GROUP + offs[None, :]
        ok = (offs[None, :] < GROUP) & (cols < K)
        x = tl.load(x_row + cols * stride_xk, mask=ok, other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), _EPS), _FP8_MAX)
        _quantize_tile(x, scale, q_row + cols, ok, HW_CAST)
    else:
        amax = tl.zeros((GROUPS,), dtype=tl.float32)
        for c in range(CHUNKS):
            cols = groups[:, None] * GROUP + c * BLOCK + offs[None, :]
            ok = (c * BLOCK + offs[None, :] < GROUP) & (cols < K)
            x = tl.load(x_row + cols * stride_xk, mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.div_rn(tl.maximum(amax, _EPS), _FP8_MAX)
        for c in range(CHUNKS):
            cols = groups[:, None] * GROUP + c * BLOCK + offs[None, :]
            ok = (c * BLOCK + offs[None, :] < GROUP) & (cols < K)
            x = tl.load(x_row + cols * stride_xk, mask=ok, other=0.0).to(tl.float32)
            _quantize_tile(x, scale, q_row + cols, ok, HW_CAST)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < tl.cdiv(K, GROUP))


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]):
    quant_ref.quantize_fp8_groups in one launch, with its fp32 ops, so its bits."""
    if x.dim() != 2 or group <= 0:
        raise ValueError(
            f"quantize_fp8_groups: x {tuple(x.shape)} must be [M, K] and group ({group}) positive"
        )
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    if group <= QUANT_ONE_PASS:
        block, chunks = triton.next_power_of_2(group), 1
        groups = min(max(1, QUANT_PROGRAM_ELEMENTS // block), triton.next_power_of_2(num_groups))
    else:
        block, chunks, groups = QUANT_CHUNK, triton.cdiv(group, QUANT_CHUNK), 1
    _quantize_kernel[(m, triton.cdiv(num_groups, groups))](
        x,
        q.view(torch.uint8),
        scale,
        k,
        *x.stride(),
        q.stride(0),
        scale.stride(0),
        GROUP=group,
        GROUPS=groups,
        BLOCK=block,
        CHUNKS=chunks,
        HW_CAST=supports_fp8(x) and x.is_cuda,
        num_warps=8 if groups * block >= 4096 else 4,
    )
    return q, scale


# The batch size does not specialize: one compiled variant per tile config serves every batch.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_xsm,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_ym,
    stride_yn,
    X_GROUP: tl.constexpr,
    X_STEP: tl.constexpr,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    W_STEP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # X_GROUP: activation group (0: weight-only, x as it is). X_STEP / W_STEP: that scale changes
    # along K, so it is applied per K step (BLOCK_K divides its width), else once at the end.
    #
    # Grouped launch order: GROUP_M row tiles sweep the column tiles together, so a weight tile
    # is read from HBM once and from L2 by the others (prefill; decode has one row tile).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + cols.to(tl.int64)[None, :] * stride_wn  # W.T's [BLOCK_K, BLOCK_N] tile
    xs_rows = xs_ptr + rows.to(tl.int64) * stride_xsm
    ws_cols = ws_ptr + (cols // W_BLOCK_N) * stride_wsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        a = tl.load(
            x_base + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        b = tl.load(
            w_base + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        if X_GROUP == 0:
            b = b.to(a.dtype)  # exact: every e4m3 value is a bf16, fp16 and fp32 value
        if X_STEP or W_STEP:
            part = tl.dot(a, b, input_precision=PRECISION)
            if X_STEP:
                xs = tl.load(xs_rows + k0 // X_GROUP, mask=row_ok, other=0.0)
                part = part * xs[:, None]
            if W_STEP:
                ws = tl.load(ws_cols + (k0 // W_BLOCK_K) * stride_wsk, mask=col_ok, other=0.0)
                part = part * ws.to(tl.float32)[None, :]
            acc += part
        else:
            # fp8: Hopper's accumulator is promoted to fp32 every BLOCK_K (its default never does).
            acc = tl.dot(
                a,
                b,
                acc,
                input_precision=PRECISION,
                max_num_imprecise_acc=BLOCK_K if X_GROUP else 0,
            )
    if X_GROUP and not X_STEP:
        acc = acc * tl.load(xs_rows, mask=row_ok, other=0.0)[:, None]
    if not W_STEP:
        acc = acc * tl.load(ws_cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_config(m: int) -> dict[str, int]:
    """Tile sizes by batch rows (tunables: sweep each bucket on the GPU at the model's N x K).

    Decode (up to 16 rows) is bound by the weights' bytes: 16-row tiles (the smallest the tensor
    cores take) and narrow column tiles spread the weight over many programs, each with several
    K steps in flight. Prefill is bound by the tensor cores: 128 x 128 tiles over 8 warps (two
    warp groups of Hopper's 64-row MMA). BLOCK_K is 128, one (128, 128) scale block per step;
    `fp8_matmul` lowers it where a block or group is narrower. Each bucket is one compiled variant.
    """
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if m <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}


def _pow2_divisor(n: int) -> int:
    return n & -n


def _block_k(tile_k: int, k: int, widths: list[int], w8a8: bool, what: str) -> int:
    """BLOCK_K: at most the config's, and a divisor of every scale width narrower than K (so a K
    step sees one scale of each); fp8 dots need 32, others 16."""
    for width in widths:
        if width < k:
            tile_k = min(tile_k, _pow2_divisor(width))
    least = 32 if w8a8 else 16
    if tile_k < least:
        raise ValueError(
            f"fp8_matmul: {what} leave K steps of {tile_k}, under the {least} a "
            f"{'fp8' if w8a8 else 'weight-only'} dot needs: scale widths along K must be "
            f"multiples of {least} (or cover all of K={k})"
        )
    return tile_k


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    act_group: int,
    config: dict[str, int] | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T for W = float8_e4m3fn weight [N, K] with float32 scale [ceil(N / bn),
    ceil(K / bk)], block = (bn, bk).

    act_group > 0 (W8A8): x is quantized per `act_group` elements of a row (quantize_fp8_groups)
    and multiplied on the fp8 tensor cores, the scales applied to the fp32 sums: (128, 128) blocks
    with act_group 128 (DeepSeek-V3, Kimi K2), (1, K) with act_group K (channel-wise weights,
    per-token activations). Any act_group and bk that are multiples of 32 or cover K work.
    act_group == 0 (weight-only): x meets the fp8 weight converted to x's dtype; bk a multiple
    of 16 or K. Returns [M, N] in x's dtype (bf16, fp16 or fp32). `config`: tile sizes in place of
    tile_config(M)'s (tests use small ones).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8_matmul: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K], [N, K]"
        )
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_matmul: weight is {weight.dtype}, not torch.float8_e4m3fn")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_matmul: x is {x.dtype}; bf16, fp16 or fp32 are supported")
    m, k = x.shape
    n = weight.shape[0]
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"fp8_matmul: block {block} must be two positive sizes (rows, cols)")
    bn, bk = block
    want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(scale.shape) != want or not scale.is_floating_point():
        raise ValueError(
            f"fp8_matmul: scale {tuple(scale.shape)} {scale.dtype} does not fit weight "
            f"{tuple(weight.shape)} in {block} blocks: want float {list(want)}"
        )
    if act_group < 0:
        raise ValueError(f"fp8_matmul: act_group {act_group} must be >= 0 (0: weight-only)")
    if not supports_fp8(x):
        raise RuntimeError(
            f"fp8_matmul: Triton's e4m3 needs compute capability {MIN_CAPABILITY}+, this GPU is "
            f"{capability(x)}: keep the weights dequantized (quant_ref.dequantize_fp8)"
        )
    core = m <= CORE_MAX_ROWS and fits_core(k, block, act_group)
    kernel = kernel or ("core_gemv" if core else "gemm")
    if kernel not in ("core_gemv", "gemm") or (kernel == "core_gemv" and not core):
        raise ValueError(
            f"fp8_matmul: kernel {kernel!r} does not take {m} rows with block {block} and "
            f"act_group {act_group} (core_gemv: up to {CORE_MAX_ROWS} rows, scale widths along "
            "K multiples of 16; gemm: any)"
        )
    if kernel == "core_gemv":
        a, a_scale = quantize_fp8_groups(x, act_group) if act_group else (x, None)
        return fp8_core_gemv(a, a_scale, weight, scale, block, act_group, x.dtype, config)
    config = dict(config or tile_config(m))
    w8a8 = act_group > 0
    widths = [bk, act_group] if w8a8 else [bk]
    what = f"block {block} with act_group {act_group}"
    config["BLOCK_K"] = _block_k(config["BLOCK_K"], k, widths, w8a8, what)
    group_m = config.pop("GROUP_M", 8)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0 or k == 0:
        return y.zero_()
    if w8a8:
        a, a_scale = quantize_fp8_groups(x, act_group)
    else:
        a, a_scale = x, scale  # a_scale is never read
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _fp8_gemm_kernel[grid](
        a,
        a_scale,
        weight,
        scale,
        y,
        m,
        n,
        k,
        *a.stride(),
        a_scale.stride(0),
        *weight.stride(),
        *scale.stride(),
        *y.stride(),
        X_GROUP=act_group,
        X_STEP=w8a8 and act_group < k,
        W_BLOCK_N=bn,
        W_BLOCK_K=bk,
        W_STEP=bk < k,
        PRECISION=dot_precision(x.dtype),
        GROUP_M=group_m,
        **config,
    )
    return y
