"""Packed-INT weights times float activations (W4A16 / W8A16), dequantized in registers (Triton).

The weight is compressed-tensors' `pack-quantized` layout as ember/kernels/quant_ref.py describes
it (int32 words, element j of a row at bit (j % per_word) * bits of word j // per_word, stored as
q + 2**(bits - 1)), with a scale (and an int8 zero point, or none) per `group_size` elements of
a row. Every kernel loads steps of words and dequantizes them in registers, with fp32
accumulation; the weight is never written out dequantized. Three kernels, by rows of x
(`kernel_for`):

- **CUDA-core GEMV, 1..CORE_MAX_ROWS rows** (`_core_gemv_kernel`): decode of a few sequences,
  where the weights' bytes set the time. Each program owns BLOCK_N output columns and walks its
  range of K; a thread loads 16 bytes (a chunk of CHUNK words) of each of the BLOCK_N rows a
  step, the lanes and warps along K, so every field of a word stays in its thread. A field is
  masked and or-ed with the exponent bits of 2**(23 - b), b its bit in the word (or in the word
  shifted right): the float 2**(23 - b) + u, less 2**(23 - b) + 2**(bits - 1), is q exactly (a
  LOP3 and an FADD, no int-to-float conversion; `_core_fields`). The exact integers meet x in
  fp32 FFMAs, a chunk's 32 (int4) products summed in its thread, less z times the chunk's sum of
  x (zero points), and multiplied once by the group's scale (channel-wise: once a row, at the
  end): one LOP3, FADD and FFMA a weight at one row (int4 with 16-bit x: three fields in eight
  keep their offsets, paid back once a chunk from x), each row more one FFMA. The weight is
  never rounded to x's dtype, so the result is at least as close to the exact product as
  `int_matmul_ref`'s, not bit for bit its. A branch on M (no specialization) runs a loop of 1,
  2 or 4 rows of x. K splits where the column tiles are fewer than the SMs, as below.
- **Tensor-core GEMV, up to GEMV_MAX_ROWS rows** (`_int_gemv_kernel`): the rows sit in one
  16-row tile (masked past M), so one compiled variant serves them all, and the multiply-adds
  run on the tensor cores: 16 rows cost what one does, and the CUDA cores only dequantize. Each
  program owns BLOCK_N output columns and a range of K; when the column tiles alone would not
  fill the SMs, K is split and each split writes fp32 partial sums that `_sum_splits_kernel`
  adds in a fixed order (deterministic, graph-safe; one more launch, only for N below ~8K).
- **GEMM, more rows** (`_int_gemm_kernel`): BLOCK_M x BLOCK_N tiles launched in grouped order
  (GROUP_M row tiles sweep the column tiles together, so a weight tile is read from HBM once and
  from L2 after); up to 64 rows, K split in two where the column tiles do not fill the SMs.

The tensor-core kernels dequantize so:

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

M never specializes (`do_not_specialize`): each GEMV has one variant per weight shape, the GEMM
one per `gemm_config` bucket (two), so start-up compiles them all and no request does.

Speed. Measured on an H200 (CUDA graphs, weights beyond L2, INT4 in groups of 128, one bf16
row): the tensor-core GEMV was no faster than the bf16 GEMV (ember/kernels/gemv.py) though it
reads a quarter of the bytes, 22.9 us against 16.9 at 6144 x 4096 (bytes over the copy rate:
4.7), its best tiles 18.2: its dequantization, not the bytes, bound it. Hence the CUDA-core GEMV
for a few rows; benchmarks/probes/int_gemv_sweep.py times it over its tiles. sm_90 SASS of its
one-row loop (Triton 3.6, the default tiles, bf16 x, groups of 128): ~3.5 instructions a weight
(~7.6 at four rows); the tensor-core GEMV's, in instructions a weight per thread: int4
channel-wise 5.8, groups of 128 6.6, of 32 7.9 (10.9 with zero points); int8 6.1-7.9. The next
lever for the tensor-core kernels is dequantizing two weights an instruction (bf16x2 magic
numbers and HFMA2, through inline PTX); splitting x per plane and the per-step wgmma fences are
most of the rest (~1.5 a weight at BLOCK_K 256). What to sweep on an H200, for the N x K of
Llama-8B (4096 x 4096, 6144 x 4096, 28672 x 4096, 4096 x 14336, 128256 x 4096) and Moonlight's
experts (2816 x 2048, 2048 x 1408): GEMV BLOCK_N {64, 128 with 8 warps}, BLOCK_K {128, 256,
512} * 4 / bits, num_stages {2, 3, 4, 5}, SPLIT_K's target (1, 2, 4 programs an SM); GEMM
BLOCK_M {64, 128}, BLOCK_N {64, 128, 256}, BLOCK_K {64, 128, 256} * 4 / bits, and the M
bucket's edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import dot_precision, num_sms
from ember.kernels.quant_ref import per_word

CORE_MAX_ROWS = 4
"""Up to this many rows take the CUDA-core GEMV (`_core_gemv_kernel`). A row more costs it one
FFMA a weight (~3.5 instructions a weight at one row, ~7.6 at four, sm_90 SASS); the tensor-core
GEMV costs ~6.6 at any count up to 16, but measured no faster at one row than the bf16 GEMV."""
GEMV_MAX_ROWS = 16
"""Up to this many rows take a GEMV (the tensor-core one: one 16-row tile); more take the GEMM."""
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
MAGIC_BITS = 0x4B000000
"""The bits of 2**23 in fp32, passed to the CUDA-core GEMV as an argument (see `_core_fields`):
an argument, not a literal, so that a field's mask and or stay one LOP3 (it takes one
immediate)."""


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


# The CUDA-core GEMV. Its layout, which the shapes below are chosen to get from Triton's passes
# (sm_90 TTGIR and SASS, Triton 3.6): a thread owns CHUNK contiguous words (one 16-byte load) of
# each of BLOCK_N rows, the lanes and then the warps lie along K (chunk u of a step is thread u),
# and every field of a word stays in its thread. Tensors put the chunk dimension first: where
# axis contiguity ties, Triton's coalescing orders dimensions by index, so the first gets the
# lanes. x's [U, CHUNK, per_word] pointer then gives each thread its own chunk's x with no layout
# conversion (no shared memory, no barrier), and tl.join, unlike expand_dims, keeps a word's
# fields in its thread. The warps must lie along K for this (x would otherwise be replicated
# across them, through shared memory): BLOCK_KW >= CHUNK * 32 * num_warps.
CHUNK = tl.constexpr(4)
"""Words a thread loads of a row a step: one 16-byte load, 32 int4 or 16 int8 fields, never
more than a group (MIN_GROUP)."""


# Three int4 fields whose offsets _core_fields may leave in (DEFER): they sit at bits 16 (field 4,
# of the word), 15 and 19 (fields 6 and 7, of the word >> 9), so they read as 128 + u, 256 + u
# and 16 + u; `_core_row` takes the offsets' products with x off a chunk's sum once.
DEFERRED_OFFSETS = tl.constexpr((136, 264, 24))
"""2**(23 - b) + 8 of fields 4, 6 and 7 of an int4 word (DEFER)."""


@triton.jit
def _core_fields(words, magic, BITS: tl.constexpr, DEFER: tl.constexpr):
    """A step's words [U, BLOCK_N, CHUNK] -> their fields in fp32, in the order of K:
    [U, BLOCK_N, CHUNK * per_word], q exactly (DEFER: fields 4, 6 and 7 of an int4 word
    q + DEFERRED_OFFSETS, also exact).

    A field sits at bit b of the word or of the word shifted right (int4: fields 0-4 at
    b = 4j of the word, 5-7 at 4j - 9 of the word >> 9; int8: the high half at 8j - 12 of the
    word >> 12): every field ends by bit 22, inside fp32's 23-bit mantissa, and none lies at
    bit 0 of a shifted word (a shift and a mask from bit 0 become a bit-field extract, two
    instructions instead of one). Masked out and or-ed with the bits of 2**(23 - b), a field u
    reads as the float 2**(23 - b) + u: one LOP3, no int-to-float conversion (a quarter-rate
    instruction). Subtracting 2**(23 - b) + 2**(bits - 1) leaves q exactly (integers below
    2**24). Per word: one shift, then a LOP3 and an FADD a field, but for the deferred three."""
    PER_WORD: tl.constexpr = 32 // BITS
    U: tl.constexpr = words.shape[0]
    BN: tl.constexpr = words.shape[1]
    HIGH: tl.constexpr = 5 if BITS == 4 else 2  # the first field read from the shifted word
    SHIFT: tl.constexpr = 9 if BITS == 4 else 12
    j = tl.arange(0, PER_WORD)
    shift = (j >= HIGH).to(tl.int32) * SHIFT
    b = j * BITS - shift
    # Joins of the words with themselves make the fields' dimension: a join's new dimension is
    # per thread, so the fields of a word stay in its thread (expand_dims and broadcast spread
    # them over the lanes).
    w = tl.join(words, words)
    w = tl.join(w, w)
    if PER_WORD == 8:
        w = tl.join(w, w)
    w = tl.reshape(w, (U, BN, CHUNK, PER_WORD))
    exponent = magic - (b << 23)  # the bits of 2**(23 - b)
    f = (((w >> shift) & (((1 << BITS) - 1) << b)) | exponent).to(tl.float32, bitcast=True)
    offset = exponent.to(tl.float32, bitcast=True) + (1 << (BITS - 1))
    if DEFER:
        # The where's condition is a constant in each register (a word's fields are in its
        # thread): the subtraction of 0 folds away.
        offset = tl.where((j == 4) | (j >= 6), 0.0, offset)
    return tl.reshape(f - offset, (U, BN, CHUNK * PER_WORD))


@triton.jit
def _core_x(
    x_ptr,
    row,
    kw0,
    K,
    stride_xm,
    stride_xk,
    BITS: tl.constexpr,
    U: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Row `row` of x at a step's fields, fp32 [U, CHUNK * per_word]: chunk u holds the x of
    words kw0 + CHUNK * u onward, the ones thread u multiplies (zeros past K)."""
    PER_WORD: tl.constexpr = 32 // BITS
    u = tl.arange(0, U)
    i = tl.arange(0, CHUNK)
    j = tl.arange(0, PER_WORD)
    k = (kw0 + CHUNK * u[:, None, None] + i[None, :, None]) * PER_WORD + j[None, None, :]
    ptrs = x_ptr + row * stride_xm + k * stride_xk  # row < 4: no int32 overflow
    x = tl.load(ptrs) if EVEN else tl.load(ptrs, mask=k < K, other=0.0)
    return tl.reshape(x.to(tl.float32), (U, CHUNK * PER_WORD))


@triton.jit
def _core_row(
    acc,
    w,
    s,
    z,
    x_ptr,
    row,
    kw0,
    K,
    stride_xm,
    stride_xk,
    BITS: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_ZP: tl.constexpr,
    SCALED: tl.constexpr,
    DEFER: tl.constexpr,
):
    """acc [U, BLOCK_N] plus each chunk's products with row `row` of x: one sum a chunk (a chain
    of FFMAs in its thread), less the deferred offsets' products (DEFER) and z times the chunk's
    sum of x (HAS_ZP: sum (q - z) x = sum q x - z sum x), both shared by the rows, times its
    group's scale (SCALED), or not (channel-wise: the scale comes at the end)."""
    U: tl.constexpr = w.shape[0]
    x = _core_x(x_ptr, row, kw0, K, stride_xm, stride_xk, BITS, U, EVEN)
    d = tl.sum(w * x[:, None, :], axis=2)
    if DEFER:
        # x's fields 4, 6 and 7 of each word (field j = 4a + 2b + c: split c, then b, then a).
        even, odd = tl.split(tl.reshape(x, (U, CHUNK, 2, 2, 2)))
        e0, e1 = tl.split(even)
        _, o1 = tl.split(odd)
        _, x4 = tl.split(e0)
        _, x6 = tl.split(e1)
        _, x7 = tl.split(o1)
        paid = x4 * DEFERRED_OFFSETS[0] + x6 * DEFERRED_OFFSETS[1] + x7 * DEFERRED_OFFSETS[2]
        d -= tl.sum(paid, axis=1)[:, None]
    if HAS_ZP:
        d -= z * tl.sum(x, axis=1)[:, None]
    return acc + d * s if SCALED else acc + d


@triton.jit
def _core_loop(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    cols,
    M,
    N,
    K,
    KW,
    kw_begin,
    kw_end,
    magic,
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
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    STAGES: tl.constexpr,
):
    """W[cols, words kw_begin:kw_end] @ x[r].T for the first ROWS rows of x (rows past M repeat
    row M - 1; the caller does not store them): four [BLOCK_N] fp32 sums, the unused ones 0.

    Each row's weights are dequantized once and multiplied with every row of x in registers: a
    row of x more costs one FFMA a weight (and ~30 registers a thread)."""
    PER_WORD: tl.constexpr = 32 // BITS
    U: tl.constexpr = BLOCK_KW // CHUNK
    WORDS_PER_GROUP: tl.constexpr = GROUP_SIZE // PER_WORD
    # Columns past N read row N - 1 (in bounds, so the loads need no mask) and are not stored.
    rows_w = tl.minimum(cols, N - 1).to(tl.int64)
    u = tl.arange(0, U)
    i = tl.arange(0, CHUNK)
    w_rows = w_ptr + rows_w[None, :, None] * stride_wn
    s_rows = s_ptr + rows_w[None, :] * stride_sn
    z_rows = z_ptr + rows_w[None, :] * stride_zn
    r1 = tl.minimum(M - 1, 1)
    r2 = tl.minimum(M - 1, 2)
    r3 = tl.minimum(M - 1, 3)
    z = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if GROUP_SIZE == 0 and HAS_ZP:  # channel-wise: one zero point a row, read once
        z = tl.load(z_rows).to(tl.float32)
    s = z  # channel-wise: not read (_core_row's SCALED is off)
    acc0 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((U, BLOCK_N), dtype=tl.float32)
    SCALED: tl.constexpr = GROUP_SIZE > 0
    # Deferred offsets (int4, 16-bit x): x times 2**(23 - b) + u is exact in fp32 (9 + 11 bits
    # at most); a chunk's sum then carries up to ~270 |x| a field, so its rounding grows from
    # ~2**-24 to ~2**-16 of it (7e-7 of the output against 1e-7, fp16 x, K 2048), far inside the
    # reference's 16-bit weights (2**-9 to 2**-12 each). fp32 x keeps every field exact before
    # its product.
    DEFER: tl.constexpr = BITS == 4 and x_ptr.dtype.element_ty != tl.float32
    # An explicit num_stages: Triton pipelines a loop's loads (cp.async into shared memory)
    # without a tl.dot in it only when the loop asks.
    for kw0 in tl.range(kw_begin, kw_end, BLOCK_KW, num_stages=STAGES):
        kw = kw0 + CHUNK * u[:, None, None] + i[None, None, :]
        if EVEN:
            words = tl.load(w_rows + kw * stride_wk)
        else:
            words = tl.load(w_rows + kw * stride_wk, mask=kw < KW, other=0)
        sg, zg = s, z
        if GROUP_SIZE > 0:
            # A chunk lies in one group (CHUNK words hold at most MIN_GROUP fields).
            g = (kw0 + CHUNK * u) // WORDS_PER_GROUP
            if not EVEN:
                g = tl.minimum(g, K // GROUP_SIZE - 1)  # chunks past K: any group in bounds
            sg = tl.load(s_rows + g[:, None] * stride_sk).to(tl.float32)
            if HAS_ZP:
                zg = tl.load(z_rows + g[:, None] * stride_zk).to(tl.float32)
        w = _core_fields(words, magic, BITS, DEFER)
        acc0 = _core_row(
            acc0, w, sg, zg, x_ptr, 0, kw0, K, stride_xm, stride_xk, BITS, EVEN, HAS_ZP, SCALED,
            DEFER,
        )  # fmt: skip
        if ROWS > 1:
            acc1 = _core_row(
                acc1, w, sg, zg, x_ptr, r1, kw0, K, stride_xm, stride_xk, BITS, EVEN, HAS_ZP,
                SCALED, DEFER,
            )  # fmt: skip
        if ROWS > 2:
            acc2 = _core_row(
                acc2, w, sg, zg, x_ptr, r2, kw0, K, stride_xm, stride_xk, BITS, EVEN, HAS_ZP,
                SCALED, DEFER,
            )  # fmt: skip
            acc3 = _core_row(
                acc3, w, sg, zg, x_ptr, r3, kw0, K, stride_xm, stride_xk, BITS, EVEN, HAS_ZP,
                SCALED, DEFER,
            )  # fmt: skip
    y0 = tl.sum(acc0, axis=0)
    y1 = tl.sum(acc1, axis=0)
    y2 = tl.sum(acc2, axis=0)
    y3 = tl.sum(acc3, axis=0)
    if GROUP_SIZE == 0:  # channel-wise: the row's scale, once
        s = tl.load(s_ptr + rows_w * stride_sn).to(tl.float32)
        y0 *= s
        y1 *= s
        y2 *= s
        y3 *= s
    return y0, y1, y2, y3


@triton.jit
def _core_store(y_ptr, y, r, cols, M, N, pid_k, PARTIAL: tl.constexpr):
    """Row r of the output (if r < M): into y [M, N] in its dtype, or (PARTIAL) into split
    pid_k's fp32 slab of the partial sums [splits, M, N]."""
    offs = r * N + cols
    mask = (cols < N) & (r < M)
    if PARTIAL:
        tl.store(y_ptr + pid_k.to(tl.int64) * M * N + offs, y, mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# M must not specialize: one variant serves 1..CORE_MAX_ROWS rows, each count taking its branch.
@triton.jit(do_not_specialize=["M"])
def _core_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    KW,
    kw_split,
    magic,
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
    PARTIAL: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    STAGES: tl.constexpr,
):
    # Program (n, s): columns [n * BLOCK_N, +BLOCK_N) over split s's words. A branch on M (one
    # variant, uniform across the grid) runs a loop with 1, 2 or 4 rows of x: one row pays for
    # no other's multiply-adds. The four-row loop sets the kernel's registers (168-253 a thread
    # at BLOCK_N 8, as ptxas schedules it; the one-row loop alone takes ~70).
    pid_k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kw_begin = pid_k * kw_split
    kw_end = tl.minimum(kw_begin + kw_split, KW)
    if M == 1:
        y0, y1, y2, y3 = _core_loop(
            x_ptr, w_ptr, s_ptr, z_ptr, cols, M, N, K, KW, kw_begin, kw_end, magic,
            stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn,
            stride_zk, BITS, GROUP_SIZE, HAS_ZP, EVEN, 1, BLOCK_N, BLOCK_KW, STAGES,
        )  # fmt: skip
    elif M == 2:
        y0, y1, y2, y3 = _core_loop(
            x_ptr, w_ptr, s_ptr, z_ptr, cols, M, N, K, KW, kw_begin, kw_end, magic,
            stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn,
            stride_zk, BITS, GROUP_SIZE, HAS_ZP, EVEN, 2, BLOCK_N, BLOCK_KW, STAGES,
        )  # fmt: skip
    else:
        y0, y1, y2, y3 = _core_loop(
            x_ptr, w_ptr, s_ptr, z_ptr, cols, M, N, K, KW, kw_begin, kw_end, magic,
            stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk, stride_zn,
            stride_zk, BITS, GROUP_SIZE, HAS_ZP, EVEN, 4, BLOCK_N, BLOCK_KW, STAGES,
        )  # fmt: skip
    _core_store(y_ptr, y0, 0, cols, M, N, pid_k, PARTIAL)
    _core_store(y_ptr, y1, 1, cols, M, N, pid_k, PARTIAL)
    _core_store(y_ptr, y2, 2, cols, M, N, pid_k, PARTIAL)
    _core_store(y_ptr, y3, 3, cols, M, N, pid_k, PARTIAL)


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


def core_gemv_config(n: int, k: int, bits: int, sms: int = DEFAULT_SMS) -> dict[str, int]:
    """The CUDA-core GEMV's tiles for a weight of [n, k] (tunables: reasoning and sm_90 SASS;
    benchmarks/probes/int_gemv_sweep.py sweeps them on a GPU).

    - BLOCK_N 8: a thread holds 8 rows x CHUNK words a step (32 registers of words, 256 int4
      weights), over which x's load and conversion (a chunk's 32 fields) spread. sm_90 SASS of
      the one-row loop, int4 in groups of 128, bf16 x: 3.46 instructions a weight (a LOP3 and
      an FFMA each, an FADD for 5 of 8; loads, addresses and x's conversion the rest), 7.6 at
      four rows; BLOCK_N 4: 3.85 and 8.8; 16: 3.24, but its four-row loop spills. 168 registers
      a thread (127 at BLOCK_N 4): the four-row loop's, in the same variant.
    - num_warps 2, BLOCK_KW 256 (the layout's one chunk a thread: 128 * num_warps words): 2,048
      int4 fields a step, so Llama's K (4096, 14336) takes no masks, and programs of 64 threads
      (six an SM at 168 registers: 12 warps).
    - num_stages and SPLIT_K: as swept (below).
    """
    block_n, warps = 8, 2
    block_kw = CHUNK.value * 32 * warps
    # Swept on an H200 (benchmarks/probes/int_gemv_sweep.py, 14 cases at Llama-8B's and
    # Moonlight's shapes, 1, 2 and 4 rows): one stage, no split and at most 128 registers a
    # thread came within 3% of each one-row case's best (geometric mean) and 8% of the
    # multi-row cases'; the reasoned defaults above with two stages and the split were 1.8-2.5x
    # slower at one row (qkv 19.4 against 8.2 us).
    return dict(
        BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=1, num_warps=warps, num_stages=1, maxnreg=128
    )


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


def kernel_for(m: int) -> str:
    """The kernel `int_matmul` runs for m rows of x: up to CORE_MAX_ROWS the CUDA-core GEMV, up to
    GEMV_MAX_ROWS the tensor-core GEMV, more the GEMM."""
    if m <= CORE_MAX_ROWS:
        return "core_gemv"
    return "tc_gemv" if m <= GEMV_MAX_ROWS else "gemm"


def _check_config(config: dict[str, int], bits: int, kernel: str) -> None:
    """The tiles' keys (the chosen kernel's) and constraints. The tensor-core kernels: powers of
    two of at least 16 (tl.dot), BLOCK_K at least 16 fields of every word (each plane's dot spans
    BLOCK_K / per_word). The CUDA-core GEMV: powers of two, BLOCK_KW at least a chunk."""
    sizes = {
        "core_gemv": ("BLOCK_N", "BLOCK_KW"),
        "tc_gemv": ("BLOCK_N", "BLOCK_K"),
        "gemm": ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
    }[kernel]
    keys = {*sizes, "num_warps", "num_stages", *(("GROUP_M",) if kernel == "gemm" else ())}
    # Optional: SPLIT_K (1 if absent); the CUDA-core GEMV's maxnreg (Triton's cap on registers
    # a thread, for the sweep: its four-row loop sets the kernel's count).
    optional = {"SPLIT_K", "maxnreg"} if kernel == "core_gemv" else {"SPLIT_K"}
    if set(config) - optional != keys:
        raise ValueError(
            f"tiles {config}: the {kernel} kernel's are {sorted(keys)}, optionally "
            f"{sorted(optional)}"
        )
    if kernel == "core_gemv":
        if not all(_power_of_two(config[s]) for s in sizes) or config["BLOCK_KW"] < CHUNK.value:
            raise ValueError(
                f"tiles {config}: BLOCK_N and BLOCK_KW must be powers of two, BLOCK_KW at least "
                f"{CHUNK.value}"
            )
        return
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
    kernel: str | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32, contiguous rows) @ W.T for the packed INT weight W [N, K] of
    quant_ref.py's layout: packed int32 [N, ceil(K*bits/32)], scale [N, K/group_size] (bf16,
    fp16 or fp32), zero_point int8 [N, K/group_size] or None. Returns [M, N] in x's dtype.
    `kernel_for(M)` picks the kernel: the CUDA-core GEMV, the tensor-core GEMV or the GEMM.

    bits: 4 or 8. group_size: K (channel-wise), or a power of two of at least 32 that divides K
    (32, 64, 128 ...). `kernel` runs another kernel that takes M rows ("core_gemv" up to
    CORE_MAX_ROWS, "tc_gemv" up to GEMV_MAX_ROWS, "gemm" any); `config` overrides its tiles
    (`core_gemv_config`, `gemv_config`, `gemm_config`): tests, sweeps. Anything else raises
    ValueError.
    """
    _check(x, packed, scale, zero_point, bits, group_size)
    m, k = x.shape
    n = packed.shape[0]
    limit = {"core_gemv": CORE_MAX_ROWS, "tc_gemv": GEMV_MAX_ROWS, "gemm": None}
    kernel = kernel or kernel_for(m)
    if kernel not in limit or m > (limit[kernel] or m):
        raise ValueError(f"kernel {kernel!r} does not take {m} rows (limits: {limit})")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    if config is None:
        sms = num_sms(x) if x.is_cuda else DEFAULT_SMS
        if kernel == "gemm":
            config = gemm_config(m, n, k, bits, sms)
        else:
            pick = core_gemv_config if kernel == "core_gemv" else gemv_config
            config = pick(n, k, bits, sms)
    _check_config(config, bits, kernel)
    config = dict(config)
    # The K range in the kernel's unit (fields, or words for the CUDA-core GEMV), cut into
    # SPLIT_K whole steps.
    length, step = (packed.shape[1], "BLOCK_KW") if kernel == "core_gemv" else (k, "BLOCK_K")
    steps = triton.cdiv(length, config[step])
    k_split = triton.cdiv(steps, config.pop("SPLIT_K", 1)) * config[step]
    splits = triton.cdiv(length, k_split)  # no split left empty
    out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    # A zero point's pointer when there is none: never read (HAS_ZP is off).
    zp = zero_point if zero_point is not None else scale
    consts = {
        "BITS": bits,
        "GROUP_SIZE": 0 if group_size == k else group_size,
        "HAS_ZP": zero_point is not None,
        "PARTIAL": splits > 1,
    }
    if kernel == "core_gemv":
        _core_gemv_kernel[(triton.cdiv(n, config["BLOCK_N"]), splits)](
            x, packed, scale, zp, out, m, n, k, packed.shape[1], k_split, MAGIC_BITS,
            *x.stride(), *packed.stride(), *scale.stride(), *zp.stride(), **consts,
            # Every step whole and every field inside K: no masks.
            EVEN=k % (config["BLOCK_KW"] * per_word(bits)) == 0,
            STAGES=config["num_stages"], **config,
        )  # fmt: skip
    else:
        args = (
            x, packed, scale, zp, out, m, n, k, packed.shape[1], k_split, ONE_BITS,
            *x.stride(), *packed.stride(), *scale.stride(), *zp.stride(),
        )  # fmt: skip
        # 16-bit scales: the one-fma dequantization is exact (see the module's docstring).
        consts |= {"FMA": scale.dtype != torch.float32, "PRECISION": dot_precision(x.dtype)}
        if kernel == "tc_gemv":
            grid = (triton.cdiv(n, config["BLOCK_N"]), splits)
            _int_gemv_kernel[grid](*args, **consts, BLOCK_M=GEMV_MAX_ROWS, **config)
        else:
            tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
            _int_gemm_kernel[(tiles, splits)](*args, **consts, **config)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, SPLITS=splits, BLOCK=block)
    return y
