"""Packed-INT weights times float activations (W4A16 / W8A16), dequantized in registers (Triton).

The weight is compressed-tensors' `pack-quantized` layout as ember/kernels/quant_ref.py describes
it (int32 words, element j of a row at bit (j % per_word) * bits of word j // per_word, stored as
q + 2**(bits - 1)), with a scale (and an int8 zero point, or none) per `group_size` elements of
a row. Both kernels load a step of words ([BLOCK_N, BLOCK_K / per_word] int32), dequantize them
in registers into x's dtype and multiply them on the tensor cores with fp32 accumulation; the
weight is never written out dequantized.

- **Dequantizing.** Field j of each word is moved to the top of an fp32 mantissa and or-ed with
  the bits of 1.0, so f = 1 + u / 2**bits exactly, with no int-to-float conversion (a
  quarter-rate instruction). Then (q - z) * s = f * (2**bits * s) - (2**bits + 2**(bits-1) + z)
  * s: one fma, exact for 16-bit scales (both products fit fp32's mantissa), so the weight is
  rounded once to the scale's dtype and once to x's dtype, bit for bit as `int_matmul_ref`
  dequantizes it (fp32 scales take (f - c) * s, also exact).
- **Planes.** Field j of every word of a step (a plane, [BLOCK_N, BLOCK_K / per_word]) is
  multiplied by x's matching plane x[:, j::per_word]: the same sum over K in another order. A
  plane is an elementwise function of the words and of per-row terms, which lets Triton
  dequantize straight in the tensor cores' operand layout (see `_mainloop`).
- **GEMV, 1..16 rows** (`_int_gemv_kernel`): decode. The rows sit in one 16-row tile (masked
  past M), so one compiled variant serves every decode batch, and the multiply-adds run on the
  tensor cores: 16 rows cost what one does, and the CUDA cores only dequantize. Each program
  owns BLOCK_N output columns and a range of K; when the column tiles alone would not fill the
  SMs, K is split and each split writes fp32 partial sums that `_sum_splits_kernel` adds in a
  fixed order (deterministic, graph-safe; one more launch, only for N below ~8K).
- **GEMM, more rows** (`_int_gemm_kernel`): BLOCK_M x BLOCK_N tiles launched in grouped order
  (GROUP_M row tiles sweep the column tiles together, so a weight tile is read from HBM once and
  from L2 after); up to 64 rows, K split in two where the column tiles do not fill the SMs.

M never specializes (`do_not_specialize`): the GEMV has one variant per weight shape, the GEMM
one per `gemm_config` bucket (two), so start-up compiles them all and no request does.

Speed: not yet measured on a GPU. What sm_90 SASS of the main loop says (Triton 3.6, the
default tiles, bf16 x and scales), in instructions a weight per thread: int4 channel-wise 5.8,
groups of 128 6.6, of 32 7.9 (10.9 with zero points); int8 6.1-7.9. At 128 thread instructions
a clock an SM, a 4-bit stream is bound by instruction issue: 5.8 is ~22 weights a clock an SM,
~2.9 TB/s on an H200 at 1.98 GHz (~70% of the 4.1 TB/s copy rate, 60% of 4.8), groups of 128
~2.6 TB/s; 8-bit weights should be bound by memory. The next lever for int4 is dequantizing two
weights an instruction (bf16x2 magic numbers and HFMA2, through inline PTX); splitting x per
plane and the per-step wgmma fences are most of the rest (~1.5 a weight at BLOCK_K 256).
What to sweep on an H200, for the N x K of Llama-8B (4096 x 4096, 6144 x 4096, 28672 x 4096,
4096 x 14336, 128256 x 4096) and Moonlight's experts (2816 x 2048, 2048 x 1408): GEMV BLOCK_N
{64, 128 with 8 warps}, BLOCK_K {128, 256, 512} * 4 / bits, num_stages {2, 3, 4, 5}, SPLIT_K's
target (1, 2, 4 programs an SM); GEMM BLOCK_M {64, 128}, BLOCK_N {64, 128, 256}, BLOCK_K
{64, 128, 256} * 4 / bits, and the M bucket's edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import dot_precision, num_sms
from ember.kernels.quant_ref import per_word

GEMV_MAX_ROWS = 16
"""Up to this many rows take the GEMV (one 16-row tensor-core tile); more take the GEMM."""
DEFAULT_SMS = 132
"""An H200's streaming multiprocessors: the split-K choice where no GPU can be asked
(Triton's interpreter)."""
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_GROUP = 32
"""The smallest group the kernels take (a power of two; a step of BLOCK_K picks the terms of
BLOCK_K / group groups)."""
ONE_BITS = 0x3F800000
"""The bits of 1.0 in fp32, passed to the kernels as an argument (see `_plane`)."""


@triton.jit
def _plane(
    words,
    mul,
    sub,
    one,
    J: tl.constexpr,
    BITS: tl.constexpr,
    FMA: tl.constexpr,
    S_TY: tl.constexpr,
    X_TY: tl.constexpr,
):
    """Field J of every word, dequantized and rounded as the reference rounds: [R, W] in X_TY."""
    TOP: tl.constexpr = 23 - BITS  # the field's place at the top of fp32's 23-bit mantissa
    # (>> is arithmetic: the sign bits it brings in are masked off.)
    v = words << (TOP - J * BITS) if TOP >= J * BITS else words >> (J * BITS - TOP)
    # `one` holds the bits of 1.0 as a kernel argument, not a literal, so that the mask and the
    # or become one three-input LOP3 (it takes one immediate): a logic op a weight fewer.
    f = ((v & (((1 << BITS) - 1) << TOP)) | one).to(tl.float32, bitcast=True)
    # f * mul is exact for 16-bit scales, so with or without an fma the sum is rounded once.
    w = f * mul - sub if FMA else (f - sub) * mul
    return w.to(S_TY).to(X_TY)


@triton.jit
def _x_planes(x, BITS: tl.constexpr):
    """x [R, BLOCK_K] -> the 32 / BITS planes x[:, j::32 / BITS] that meet the weight planes."""
    PER_WORD: tl.constexpr = 32 // BITS
    if BITS == 4:
        # split takes the last dim: x[r, 8w + 4a + 2b + c] is [r, w, a, b, c].
        c0, c1 = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // PER_WORD, 2, 2, 2)))
        b00, b01 = tl.split(c0)
        b10, b11 = tl.split(c1)
        x0, x4 = tl.split(b00)
        x2, x6 = tl.split(b01)
        x1, x5 = tl.split(b10)
        x3, x7 = tl.split(b11)
        return x0, x1, x2, x3, x4, x5, x6, x7
    else:
        c0, c1 = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // PER_WORD, 2, 2)))
        x0, x2 = tl.split(c0)
        x1, x3 = tl.split(c1)
        return x0, x1, x2, x3


@triton.jit
def _group_terms(s_ptrs, z_ptrs, mask, BITS: tl.constexpr, HAS_ZP: tl.constexpr, FMA: tl.constexpr):
    """The two terms of each group's dequantization in fp32: w = f * mul - sub (or
    (f - sub) * mul). A masked group gets a zero scale, so its weights are exactly 0."""
    s = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptrs, mask=mask, other=0).to(tl.float32) if HAS_ZP else tl.zeros_like(s)
    offset = z + ((1 << BITS) + (1 << (BITS - 1)))  # an integer of BITS + 1 bits, exact
    mul = s * (1 << BITS)
    # offset * s is exact for 16-bit scales: BITS + 1 bits times their 8 or 11.
    sub = offset * s if FMA else offset * (1.0 / (1 << BITS))
    return mul, sub


@triton.jit
def _mainloop(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    rows,
    m_ok,
    cols,
    n_ok,
    k_begin,
    k_end,
    K,
    KW,
    one,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_zn,
    stride_zk,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZP: tl.constexpr,
    FMA: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W[cols, k_begin:k_end] @ x[rows, k_begin:k_end].T in fp32: [BLOCK_N, BLOCK_M].

    A step's words [BLOCK_N, BLOCK_K / per_word] hold per_word planes (field j of every word),
    each multiplied by the matching plane of x, x[:, j::per_word]: the same sum over K, in
    another order. Each plane is an elementwise function of the words and of per-row terms
    (broadcast), so Triton hoists the conversion to the tensor cores' operand layout above the
    dequantization: the words go from shared memory straight into that layout and the weights
    are made where the wgmma reads them (they are its register operand, hence weights x x.T),
    with no trip of the dequantized tile through shared memory (sm_90 SASS: ~6 instructions a
    weight, against ~11 for the tile unpacked in K order and fed to tl.dot). Anything that is
    not elementwise or broadcast on the way (a join, a reshape, a [BLOCK_N, BLOCK_KW] gather of
    group terms) undoes that, hence the planes and the row terms picked by tl.where."""
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PER_WORD
    S_TY: tl.constexpr = s_ptr.dtype.element_ty
    X_TY: tl.constexpr = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + cols.to(tl.int64)[:, None] * stride_sn
    z_rows = z_ptr + cols.to(tl.int64)[:, None] * stride_zn
    if GROUP_SIZE == 0:  # channel-wise: one scale (and zero point) a row, read once
        mul, sub = _group_terms(s_rows, z_rows, n_ok[:, None], BITS, HAS_ZP, FMA)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_rows + ks[None, :] * stride_xk, mask=m_ok[:, None] & (ks[None, :] < K), other=0.0
        )
        kw = k0 // PER_WORD + tl.arange(0, BLOCK_KW)
        w_ok = n_ok[:, None] & (kw[None, :] < KW)
        words = tl.load(w_rows + kw[None, :] * stride_wk, mask=w_ok, other=0)
        if GROUP_SIZE >= BLOCK_K:  # the step lies in one group: its row terms
            g = k0 // GROUP_SIZE
            mul, sub = _group_terms(
                s_rows + g * stride_sk, z_rows + g * stride_zk, n_ok[:, None], BITS, HAS_ZP, FMA
            )
        elif GROUP_SIZE > 0:  # a few groups a step: each one's row terms, picked word by word
            # (Loading the terms word by word instead, [BLOCK_N, BLOCK_KW], stops Triton from
            # dequantizing in the operand layout: 10.7 instructions a weight against 7.9, int4
            # in groups of 32.)
            word_group = (tl.arange(0, BLOCK_KW) // (GROUP_SIZE // PER_WORD))[None, :]
            g = k0 // GROUP_SIZE
            mul, sub = _group_terms(
                s_rows + g * stride_sk, z_rows + g * stride_zk, n_ok[:, None], BITS, HAS_ZP, FMA
            )
            for i in tl.static_range(1, BLOCK_K // GROUP_SIZE):
                g_ok = n_ok[:, None] & (g + i < K // GROUP_SIZE)  # the last step may end early
                mul_i, sub_i = _group_terms(
                    s_rows + (g + i) * stride_sk,
                    z_rows + (g + i) * stride_zk,
                    g_ok,
                    BITS,
                    HAS_ZP,
                    FMA,
                )
                mul = tl.where(word_group == i, mul_i, mul)
                sub = tl.where(word_group == i, sub_i, sub)
        # Fields past K (a row's last word, partly filled) meet x's zeros.
        xs = _x_planes(x, BITS)
        for j in tl.static_range(PER_WORD):
            w = _plane(words, mul, sub, one, j, BITS, FMA, S_TY, X_TY)
            acc = tl.dot(w, tl.trans(xs[j]), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _store(acc, y_ptr, rows, m_ok, cols, n_ok, M, N, pid_k, PARTIAL: tl.constexpr):
    """The tile into y [M, N] in its dtype, or (PARTIAL) into split pid_k's fp32 slab of the
    partial sums [splits, M, N]."""
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(y_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=mask)
    else:
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# M changes from batch to batch: it must not specialize, so one variant serves every batch.
@triton.jit(do_not_specialize=["M"])
def _int_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    KW,
    k_split,
    one,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_zn,
    stride_zk,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZP: tl.constexpr,
    FMA: tl.constexpr,
    PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (n, s): columns [n * BLOCK_N, +BLOCK_N) over split s's K range, every row at once.
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    m_ok = rows < M
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    k_begin = pid_k * k_split
    k_end = min(k_begin + k_split, K)
    acc = _mainloop(
        x_ptr, w_ptr, s_ptr, z_ptr, rows, m_ok, cols, n_ok, k_begin, k_end, K, KW, one,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk,
        BITS, GROUP_SIZE, HAS_ZP, FMA, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    _store(tl.trans(acc), y_ptr, rows, m_ok, cols, n_ok, M, N, pid_k, PARTIAL)


@triton.jit(do_not_specialize=["M"])
def _int_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    KW,
    k_split,
    one,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_zn,
    stride_zk,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_ZP: tl.constexpr,
    FMA: tl.constexpr,
    PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row tiles sweep the column tiles together, so a weight tile
    # (dequantized by each of them) is fetched from HBM once and served from L2 after.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // in_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < N
    k_begin = pid_k * k_split
    k_end = min(k_begin + k_split, K)
    acc = _mainloop(
        x_ptr, w_ptr, s_ptr, z_ptr, rows, m_ok, cols, n_ok, k_begin, k_end, K, KW, one,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn, stride_zk,
        BITS, GROUP_SIZE, HAS_ZP, FMA, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    _store(tl.trans(acc), y_ptr, rows, m_ok, cols, n_ok, M, N, pid_k, PARTIAL)


@triton.jit(do_not_specialize=["n"])
def _sum_splits_kernel(part_ptr, y_ptr, n, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # y[i] = sum_s part[s * n + i] in fp32, split by split (a fixed order), rounded once.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * n + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _split_k(tiles: int, k: int, block_k: int, sms: int) -> int:
    """Splits of K so that a grid of `tiles` output tiles has about two programs an SM: none when
    the tiles alone fill the SMs (the partial sums cost a write, a read and a launch)."""
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(k, block_k), triton.cdiv(2 * sms, tiles)))


def gemv_config(n: int, k: int, bits: int, sms: int = DEFAULT_SMS) -> dict[str, int]:
    """The GEMV's tiles for a weight of [n, k] (tunables: reasoning and sm_90 SASS, not a sweep).

    - BLOCK_N 64: the weights are the wgmma's M side, 64 rows a warpgroup; the x planes are
      staged in shared memory once a step for all of them.
    - BLOCK_K 1024 / bits (256 fields, 128 bytes of each row's words a step, 8 KB a step): the
      per-step work (x's planes, 32 / bits wgmma with their fences) spread over more weights;
      512 fields took 5.2 instructions a weight against 5.8 (channel-wise int4) but 200+
      registers, and a step of several groups picks their terms per word.
    - 4 stages: ~24 KB of words in flight a program, two to three programs an SM (61 KB of
      shared memory, ~125 registers): more than HBM's latency-bandwidth product asks of an SM
      (~25 KB).
    - SPLIT_K: ~two programs an SM where the column tiles are fewer than the SMs (N < 8,448:
      Llama-8B's o and down projections, Moonlight's experts). The fp32 partial sums add
      8 * splits * M / K of the weights' bytes (1% at one row, 16% at 16, K = 4096, 5 splits)
      and a ~1 us launch.
    """
    block_n, block_k = 64, 1024 // bits
    split = _split_k(triton.cdiv(n, block_n), k, block_k, sms)
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=4)


def gemm_config(m: int, n: int, k: int, bits: int, sms: int = DEFAULT_SMS) -> dict[str, int]:
    """The GEMM's tiles (tunables), in two buckets of M; within a bucket nothing depends on M,
    so one variant serves it (the split too: it is chosen from N and K).

    - Up to 64 rows (batched decode, still bound by the weights' bytes): 64 x 64 tiles, 128
      fields a step (sm_90 SASS: 9.1 instructions a weight, 80 KB of shared memory, against
      10.6 and 118 KB at 256: x's planes weigh four times the GEMV's), and K split in two where
      the column tiles do not fill the SMs (the fp32 partial sums cost 8 * splits * M / K of
      the weights' bytes: a quarter at 64 rows and K = 4096).
    - More rows: 128 x 128 tiles over 8 warps, each dequantized weight serving 128 rows (sm_90
      SASS: ~9 instructions a weight, whose issue about matches the 128-row wgmma's time;
      256-row tiles spilled), never split.
    """
    if m <= 64:
        config = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=512 // bits, num_warps=4, num_stages=4)
        split = min(2, _split_k(triton.cdiv(n, 64), k, config["BLOCK_K"], sms))
    else:
        config = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=512 // bits, num_warps=8, num_stages=3)
        split = 1
    return {**config, "GROUP_M": 8, "SPLIT_K": split}


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _check(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> None:
    """ValueError, naming the shapes, for anything the kernels do not take."""
    per_word(bits)  # raises for bits other than 4 and 8
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"x must be [M, K] of bf16, fp16 or fp32, not {x.dtype} {tuple(x.shape)}")
    k = x.shape[1]
    if packed.dim() != 2 or packed.dtype != torch.int32:
        raise ValueError(
            f"packed must be int32 [N, K * bits / 32], not {packed.dtype} {tuple(packed.shape)}"
        )
    n = packed.shape[0]
    if packed.shape[1] != triton.cdiv(k * bits, 32):
        raise ValueError(
            f"packed {tuple(packed.shape)} does not hold rows of K = {k} (x {tuple(x.shape)}) "
            f"at {bits} bits: want [N, {triton.cdiv(k * bits, 32)}]"
        )
    if group_size != k and not (
        _power_of_two(group_size) and group_size >= MIN_GROUP and k % group_size == 0
    ):
        raise ValueError(
            f"group_size {group_size} must be K = {k} (channel-wise) or a power of two of at "
            f"least {MIN_GROUP} that divides K"
        )
    groups = (n, k // group_size)
    if tuple(scale.shape) != groups or scale.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"scale must be bf16, fp16 or fp32 {groups} (N, K / group_size) for packed "
            f"{tuple(packed.shape)} and x {tuple(x.shape)}, not {scale.dtype} {tuple(scale.shape)}"
        )
    if zero_point is not None and (
        tuple(zero_point.shape) != groups or zero_point.dtype != torch.int8
    ):
        raise ValueError(
            f"zero_point must be int8 {groups} like scale (unpacked), not {zero_point.dtype} "
            f"{tuple(zero_point.shape)}"
        )


def _check_config(config: dict[str, int], bits: int, gemv: bool) -> None:
    """The tiles' keys (the GEMV's or the GEMM's, as M picks) and constraints: powers of two of at
    least 16 (tl.dot), BLOCK_K at least 16 fields of every word (each plane's dot spans
    BLOCK_K / per_word)."""
    sizes = ("BLOCK_N", "BLOCK_K") if gemv else ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    keys = {*sizes, "num_warps", "num_stages", *(() if gemv else ("GROUP_M",))}
    if set(config) - {"SPLIT_K"} != keys:
        kernel = "GEMV" if gemv else "GEMM"
        raise ValueError(f"tiles {config}: the {kernel}'s are {sorted(keys)} and SPLIT_K")
    if not all(_power_of_two(config[s]) and config[s] >= 16 for s in sizes) or (
        config["BLOCK_K"] < 16 * per_word(bits)
    ):
        raise ValueError(
            f"tiles {config}: {', '.join(sizes)} must be powers of two of at least 16, and "
            f"BLOCK_K at least {16 * per_word(bits)} at {bits} bits"
        )


def int_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    group_size: int,
    *,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32, contiguous rows) @ W.T for the packed INT weight W [N, K] of
    quant_ref.py's layout: packed int32 [N, ceil(K*bits/32)], scale [N, K/group_size] (bf16,
    fp16 or fp32), zero_point int8 [N, K/group_size] or None. Returns [M, N] in x's dtype.
    M <= GEMV_MAX_ROWS takes the GEMV kernel, larger M the GEMM kernel.

    bits: 4 or 8. group_size: K (channel-wise), or a power of two of at least 32 that divides K
    (32, 64, 128 ...). `config` overrides the tiles of `gemv_config` or `gemm_config`, the ones
    of the kernel M picks (tests, sweeps). Anything else raises ValueError.
    """
    _check(x, packed, scale, zero_point, bits, group_size)
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    gemv = m <= GEMV_MAX_ROWS
    if config is None:
        sms = num_sms(x) if x.is_cuda else DEFAULT_SMS
        config = gemv_config(n, k, bits, sms) if gemv else gemm_config(m, n, k, bits, sms)
    _check_config(config, bits, gemv)
    config = dict(config)
    block_k = config["BLOCK_K"]
    steps = triton.cdiv(k, block_k)
    k_split = triton.cdiv(steps, config.pop("SPLIT_K", 1)) * block_k
    splits = triton.cdiv(k, k_split)  # no split left empty
    out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    # A zero point's pointer when there is none: never read (HAS_ZP is off).
    zp = zero_point if zero_point is not None else scale
    args = (
        x, packed, scale, zp, out, m, n, k, packed.shape[1], k_split, ONE_BITS,
        *x.stride(), *packed.stride(), *scale.stride(), *zp.stride(),
    )  # fmt: skip
    consts = {
        "BITS": bits,
        "GROUP_SIZE": 0 if group_size == k else group_size,
        "HAS_ZP": zero_point is not None,
        # 16-bit scales: the one-fma dequantization is exact (see the module's docstring).
        "FMA": scale.dtype != torch.float32,
        "PARTIAL": splits > 1,
        "PRECISION": dot_precision(x.dtype),
    }
    if gemv:
        grid = (triton.cdiv(n, config["BLOCK_N"]), splits)
        _int_gemv_kernel[grid](*args, **consts, BLOCK_M=GEMV_MAX_ROWS, **config)
    else:
        tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
        _int_gemm_kernel[(tiles, splits)](*args, **consts, **config)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, SPLITS=splits, BLOCK=block)
    return y
