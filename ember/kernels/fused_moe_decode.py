"""Decode-sized MoE over packed INT experts on the CUDA cores: one GEMV per (token, expert) pair.

At up to fused_moe.UNSORTED_MAX_TOKENS tokens each routed pair multiplies one row by its expert's
weights. The tensor-core grouped GEMM spends a 16-row tile on that row (15 rows masked) and
dequantizes every weight into the dot's operand layout, ~7 instructions a weight: Moonlight's
INT4 experts took longer than its bf16 ones on an H200 (46.9 against 35.0 us a layer, where the
INT4 bytes take 10.7 us at the copy bandwidth). Here each program owns one pair, BLOCK_N weight
rows and a range of K, and multiplies on the CUDA cores, as ember/kernels/gemv.py does for dense
weights:

- Each 16-bit half of a word is ORed with 2**23's bits; field j (at bit BITS * j of the half) is
  then one AND away from the float 2**23 + f * 2**(BITS * j), and that minus 2**23 +
  2**(BITS - 1) * 2**(BITS * j) (a zero point's share added to this bias) is q * 2**(BITS * j)
  exactly: no shift and no int-to-float conversion a weight. The 2**(BITS * j) comes off x
  instead (exact, once a step for all of a thread's rows), so a weight costs a LOP3, a subtract
  and an fma: 3.9 SASS instructions a weight in the loop with the default tiles (4.1 where the
  steps do not divide K; sm_90, offline build). At 128 a clock an SM that is ~8.5e12 weights a
  second on an H200, a little over what its ~4.1 TB/s bring in INT4.
- A scale group's products are summed (one fma chain in one thread) before one multiply by its
  scale. For x in bf16 or fp16 each product q * x is exact in fp32.
- Gate/up: a program's rows are BLOCK_N / 2 columns' gate and up rows, interleaved (as
  gemv.gemv_silu), and it writes silu(gate) * up with fused_moe's rounding. Down: fp32 sums,
  which `_down_sum_kernel` turns into the output with fused_moe's rounding (each pair's row
  rounded, times its routing weight, rounded; the top k added in fp32 as sum_slabs): the launch
  that sum_slabs would be.
- Where the pairs' column tiles would not give SPLIT_TARGET warps an SM, K is split: the splits
  write fp32 sums and a fixed-order sum over them follows (deterministic; for gate/up one launch
  more, `_gate_up_sum_kernel`).

Rounding: the reference (quant_ref.dequantize_int, then the per-expert loop) rounds every weight
to the scales' dtype and then to x's before its matmul; here no weight is rounded, and the
products and sums are fp32, so the result is at least as close to the float64 MLP as the
reference's (tests/kernels/test_fused_moe_quant.py checks that).

Layouts: a step's words load 16 bytes a thread (a thread holds 32 INT4 or 16 INT8 values of a
row: a group of 32 INT4 values sums in one thread); x is read as int64 words of four 16-bit
values, a load small enough that Triton redoes it in each thread's layout (from L1) rather than
passing it through shared memory; the scales' row stride does not specialize, so they load one a
thread in the layout of the sums they scale. Larger groups (or INT8 in groups of 32) span
threads and cost a pass through shared memory a step: correct, slower.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import num_sms
from ember.kernels.fp8_gemm import quantize_fp8_groups
from ember.kernels.fp8_gemv import _core_loop as _fp8_core_loop

# fused_moe.py's `ExpertWeights` (one stacked projection: data, scale, zero, bits, group),
# which calls into this module: typed by its fields' use here, not imported, so the two files
# do not import each other.
ExpertWeights = Any

DEFAULT_SMS = 132
"""An H200's streaming multiprocessors: the split-K choice where no GPU can be asked."""
MAGIC = 0x4B000000
"""The bits of 2**23 in fp32. Passed as a kernel argument with HALF_SHIFT (16), not written as
literals: a field's mask and this OR then make one LOP3 (it takes one immediate), and LLVM does
not fold the shift and the masks into bit-field extracts (two SASS instructions each)."""
HALF_SHIFT = 16


@triton.jit
def _silu_mul(gate, up, DT: tl.constexpr):
    # As silu_and_mul: each projection rounded to the activations' dtype, silu(gate) rounded
    # again before the multiply (fused_moe's epilogue, bit for bit).
    gate = gate.to(DT).to(tl.float32)
    up = up.to(DT).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(DT)
    return (act.to(tl.float32) * up).to(DT)


@triton.jit
def _load_x(a_row, k0, k_in, X_PACKED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[k0 : k0 + BLOCK_K] in fp32, 0 past k_in. X_PACKED 1 (bf16) or 2 (fp16): a_row points at
    int64 words of four values each; 0: at x's own elements."""
    if X_PACKED:
        # BLOCK_K / 4 elements: under the program's thread count (for BLOCK_K <= 128 a warp),
        # which is what lets Triton load them in the layout of their use.
        kq = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        ok = kq < k_in // 4
        quads = tl.load(a_row + kq) if EVEN_K else tl.load(a_row + kq, mask=ok, other=0)
        lo = quads.to(tl.int32)
        hi = (quads >> 32).to(tl.int32)
        if X_PACKED == 1:  # a bf16's bits at the top of an fp32 are the same number
            v0 = (lo << 16).to(tl.float32, bitcast=True)
            v1 = (lo & -65536).to(tl.float32, bitcast=True)
            v2 = (hi << 16).to(tl.float32, bitcast=True)
            v3 = (hi & -65536).to(tl.float32, bitcast=True)
        else:
            v0 = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            v1 = (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            v2 = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            v3 = (hi >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_K,))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        return tl.load(a_row + ks, mask=ks < k_in, other=0.0).to(tl.float32)


# Sizes that follow the token count (num_pairs, the splits' stride o_ss) and the split do not
# specialize: one variant serves one and two tokens. s_sn / z_sn do not either, for the scales'
# layout (see the module's docstring).
@triton.jit(do_not_specialize=["num_pairs", "top_k", "steps_per_split", "o_ss", "s_sn", "z_sn"])
def _moe_gemv_int_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    experts_ptr,
    out_ptr,
    num_pairs,
    top_k,
    num_experts,
    n_out,
    k_in,
    k_words,
    k_groups,
    steps_per_split,
    a_sm,
    e_st,
    e_sk,
    w_se,
    w_sn,
    s_se,
    s_sn,
    s_sk,
    z_se,
    z_sn,
    z_sk,
    o_ss,
    o_sm,
    magic,
    half_shift,
    X_PACKED: tl.constexpr,
    GATED: tl.constexpr,
    PARTIAL: tl.constexpr,
    FOREIGN: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # Pair p = t * top_k + j is token t's j-th expert, experts[t, j]. GATED: a is x [T, K], read
    # at row t; w holds 2 * n_out rows (gate, then up). Else a is h [P, K], read at row p.
    # X_PACKED: a is int64 words of four values (a_sm in words). w int32 [E, N, k_words]; s / z
    # [E, N, k_groups], GROUP elements of K a scale (0: one a row). PARTIAL: fp32 sums
    # out[split, pair, weight row]; else h[pair, col] (GATED only). FOREIGN: experts may hold
    # num_experts, another rank's (fused_moe.py's docstring), whose pairs are skipped.
    PER_WORD: tl.constexpr = 32 // BITS
    R: tl.constexpr = 16 // BITS  # fields a 16-bit half
    BLOCK_KW: tl.constexpr = BLOCK_K // PER_WORD
    TG: tl.constexpr = BLOCK_K if GROUP == 0 or GROUP >= BLOCK_K else GROUP  # K a scale a step
    G: tl.constexpr = BLOCK_K // TG
    HALVES: tl.constexpr = TG // R

    # Pairs vary fastest: at two tokens the pairs of an expert both chose read its tiles at
    # about the same time, the second from L2.
    pid = tl.program_id(0)
    pair = pid % num_pairs
    tile = pid // num_pairs
    split = tl.program_id(1)
    token = pair // top_k
    expert = tl.load(experts_ptr + token * e_st + (pair % top_k) * e_sk).to(tl.int64)
    if FOREIGN:  # noqa: SIM102 (a constexpr branch: the one-device build has no test)
        if expert >= num_experts:  # another rank's expert: nothing to read or write
            return
    r = tl.arange(0, BLOCK_N)
    # Rows past the end read the last one (their sums are never stored): no row mask a step.
    if GATED:  # tile row 2i is gate row c + i, row 2i + 1 up row n_out + c + i
        col = tile * (BLOCK_N // 2) + r // 2
        row_ok = col < n_out
        rows = tl.minimum(col, n_out - 1) + (r % 2) * n_out
        a_row = a_ptr + token.to(tl.int64) * a_sm
    else:
        rows = tile * BLOCK_N + r
        row_ok = rows < n_out
        rows = tl.minimum(rows, n_out - 1)
        a_row = a_ptr + pair.to(tl.int64) * a_sm
    w_rows = w_ptr + expert * w_se + rows.to(tl.int64)[:, None] * w_sn
    s_rows = s_ptr + expert * s_se + rows.to(tl.int64)[:, None] * s_sn
    z_rows = z_ptr + expert * z_se + rows.to(tl.int64)[:, None] * z_sn

    # Field j of a half: its bits ANDed out of (half | 2**23's bits) spell 2**23 + f * step_j;
    # less 2**23 + 2**(BITS - 1) * step_j (the bias), that is q * step_j, exactly.
    j = tl.arange(0, R)
    field_mask = (((1 << BITS) - 1) << (j * BITS))[None, None, None, :]
    step_j = (1 << (j * BITS)).to(tl.float32)
    step = step_j[None, None, None, :]
    bias = step * (1 << (BITS - 1)) + 8388608.0
    inv_step = (1.0 / step_j)[None, None, :]
    if GROUP == 0 and HAS_ZERO:  # one zero point a row: its share of the bias, set once
        zero = tl.load(z_rows).to(tl.float32)
        bias = bias + zero[:, :, None, None] * step

    # Sums stay [BLOCK_N, G] (a thread's groups) through the loop: one reduction at the end.
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    # Whole steps a split, so the compiler knows each step's words are aligned (16-byte loads).
    k_begin = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + steps_per_split * BLOCK_K, k_in)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        # EVEN_K (K a whole number of steps): no masks in the loop at all.
        kw = k0 // PER_WORD + tl.arange(0, BLOCK_KW)
        if EVEN_K:
            words = tl.load(w_rows + kw[None, :])
        else:
            words = tl.load(w_rows + kw[None, :], mask=(kw < k_words)[None, :], other=0)
        x = _load_x(a_row, k0, k_in, X_PACKED, EVEN_K, BLOCK_K)
        step_bias = bias
        if GROUP != 0:
            groups = k0 // GROUP + tl.arange(0, G)  # G is 1 where a group spans steps
            g_ok = (groups < k_groups)[None, :]
            s_ptrs = s_rows + groups[None, :] * s_sk
            z_ptrs = z_rows + groups[None, :] * z_sk
            scale = tl.load(s_ptrs) if EVEN_K else tl.load(s_ptrs, mask=g_ok, other=0.0)
            if HAS_ZERO:  # (q - z) * step_j: still exact, z's share in the bias
                zero = tl.load(z_ptrs) if EVEN_K else tl.load(z_ptrs, mask=g_ok, other=0)
                step_bias = bias + zero.to(tl.float32)[:, :, None, None] * step
        # Joins keep a half's R copies in one thread's registers (a broadcast would spread them
        # over threads), so a word's fields, and a group of 32 INT4 values, stay in one thread.
        halves = tl.interleave(words, words >> half_shift)  # [BLOCK_N, 2 * BLOCK_KW]
        f = tl.join(halves, halves)
        if R == 4:
            f = tl.join(f, f)
        f = tl.reshape(f, (BLOCK_N, G, HALVES, R))
        q = ((f & field_mask) | magic).to(tl.float32, bitcast=True) - step_bias
        xs = tl.reshape(x, (G, HALVES, R)) * inv_step  # x / step_j, exact
        # A group's products (masked words are 0 - 8, but their x is 0) in one fma chain.
        sums = tl.sum(tl.reshape(q * xs[None, :, :, :], (BLOCK_N, G, TG)), axis=2)
        if GROUP == 0:
            acc += sums
        else:
            acc += sums * scale.to(tl.float32)
    acc = tl.sum(acc, axis=1)
    if GROUP == 0:  # one scale a row, applied once
        acc *= tl.sum(tl.load(s_rows).to(tl.float32), axis=1)

    if PARTIAL:
        tl.store(out_ptr + split * o_ss + pair * o_sm + rows, acc, mask=row_ok)
    else:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_N // 2, 2)))
        c = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        h = _silu_mul(gate, up, out_ptr.dtype.element_ty)
        tl.store(out_ptr + pair.to(tl.int64) * o_sm + c, h, mask=c < n_out)


@triton.jit(do_not_specialize=["splits", "p_ss"])
def _gate_up_sum_kernel(part_ptr, h_ptr, n_out, splits, p_ss, p_sm, h_sm, BLOCK: tl.constexpr):
    # h[pair, c] = silu(sum_s gate) * sum_s up, the splits added in order.
    pair = tl.program_id(1)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_out
    src = part_ptr + pair * p_sm + c
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        gate += tl.load(src + s * p_ss, mask=ok, other=0.0)
        up += tl.load(src + s * p_ss + n_out, mask=ok, other=0.0)
    tl.store(h_ptr + pair * h_sm + c, _silu_mul(gate, up, h_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["splits", "p_ss"])
def _down_sum_kernel(
    part_ptr,
    weight_ptr,
    experts_ptr,
    out_ptr,
    n_out,
    splits,
    num_experts,
    p_ss,
    p_sm,
    w_st,
    w_sk,
    e_st,
    e_sk,
    o_sm,
    TOP_K: tl.constexpr,
    FOREIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # out[t, c] = sum_j round(round(sum_s part[s, t k + j, c]) * round(weight[t, j])): the
    # rounding of fused_moe's down epilogue (a pair's row stored in x's dtype, its weight rounded
    # to it, the product stored) and of sum_slabs (the k rows added in fp32, in order).
    # FOREIGN: a pair of another rank's expert is left out (its sums were never written).
    t = tl.program_id(1)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_out
    DT: tl.constexpr = out_ptr.dtype.element_ty
    out = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        src = part_ptr + (t * TOP_K + j) * p_sm + c
        y = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(splits):
            y += tl.load(src + s * p_ss, mask=ok, other=0.0)
        w = tl.load(weight_ptr + t * w_st + j * w_sk).to(DT).to(tl.float32)
        term = (y.to(DT).to(tl.float32) * w).to(DT).to(tl.float32)
        if FOREIGN:
            term = tl.where(tl.load(experts_ptr + t * e_st + j * e_sk) < num_experts, term, 0.0)
        out += term
    tl.store(out_ptr + t * o_sm + c, out.to(DT), mask=ok)


# As _moe_gemv_int_kernel: the token count and the split do not specialize.
@triton.jit(do_not_specialize=["num_pairs", "top_k", "steps_per_split", "o_ss"])
def _moe_gemv_fp8_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    s_ptr,
    experts_ptr,
    out_ptr,
    num_pairs,
    top_k,
    num_experts,
    n_out,
    k_in,
    steps_per_split,
    a_sm,
    as_sm,
    e_st,
    e_sk,
    w_se,
    w_sn,
    s_se,
    s_sn,
    s_sk,
    o_ss,
    o_sm,
    GATED: tl.constexpr,
    PARTIAL: tl.constexpr,
    FOREIGN: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # FP8 block experts (w e4m3 [E, N, K], s float32 [E, N / SCALE_ROWS, K / GROUP]) times the
    # activations' e4m3 codes a [rows, K] with scales as [rows, K / GROUP] (W8A8, GROUP the
    # block's width and the activations' group; STEP: GROUP < K, the scales change along K):
    # fp8_gemv's CUDA-core loop, one row a pair.
    # Pairs, rows, GATED, PARTIAL and FOREIGN as _moe_gemv_int_kernel's.
    pid = tl.program_id(0)
    pair = pid % num_pairs
    tile = pid // num_pairs
    split = tl.program_id(1)
    token = pair // top_k
    expert = tl.load(experts_ptr + token * e_st + (pair % top_k) * e_sk).to(tl.int64)
    if FOREIGN:  # noqa: SIM102 (a constexpr branch: the one-device build has no test)
        if expert >= num_experts:  # another rank's expert: nothing to read or write
            return
    r = tl.arange(0, BLOCK_N)
    if GATED:  # tile row 2i is gate row c + i, row 2i + 1 up row n_out + c + i
        col = tile * (BLOCK_N // 2) + r // 2
        row_ok = col < n_out
        rows = tl.minimum(col, n_out - 1) + (r % 2) * n_out
        a_row = token
    else:
        rows = tile * BLOCK_N + r
        row_ok = rows < n_out
        rows = tl.minimum(rows, n_out - 1)
        a_row = pair
    rows = rows.to(tl.int64)
    w_rows = w_ptr + expert * w_se + rows[None, :, None] * w_sn
    s_rows = s_ptr + expert * s_se + (rows // SCALE_ROWS)[None, :] * s_sn
    k_begin = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + steps_per_split * BLOCK_K, k_in)
    acc, _, _, _ = _fp8_core_loop(
        a_ptr + a_row.to(tl.int64) * a_sm, as_ptr + a_row.to(tl.int64) * as_sm, w_rows, s_rows,
        0, 0, 0, 0, k_begin, k_end, k_in, 0, 1, 0, 1, s_sk, 1, GROUP, STEP, GROUP, STEP,
        BLOCK_N, BLOCK_K, EVEN_K, STAGES,
    )  # fmt: skip
    if not STEP:  # one block along K: both scales once
        acc *= tl.load(as_ptr + a_row.to(tl.int64) * as_sm)
        acc *= tl.sum(tl.load(s_rows), axis=0)
    if PARTIAL:
        tl.store(out_ptr + split * o_ss + pair * o_sm + rows, acc, mask=row_ok)
    else:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_N // 2, 2)))
        c = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        h = _silu_mul(gate, up, out_ptr.dtype.element_ty)
        tl.store(out_ptr + pair.to(tl.int64) * o_sm + c, h, mask=c < n_out)


def decode_config_int(bits: int) -> dict[str, Any]:
    """The CUDA-core path's tunables, for both projections; a "down" dict, if any, overrides
    some for the down projection. BLOCK_N: weight rows a program (for gate/up, half of them gate
    rows); BLOCK_K: K a step (a power of two >= 32); SPLIT_TARGET: warps an SM under which K is
    split; num_stages > 1: Triton pipelines the step's loads through shared memory.

    Not yet swept on a GPU (benchmarks/probes/moe_int_decode_sweep.py); why these. A thread's
    share of a 64 x 512 INT4 step at 8 warps is 4 rows x 4 words, so each x value it unpacks
    serves 4 rows: 3.9 SASS instructions a weight where the steps divide K, 4.1 where not (2 rows
    a thread: ~4.8; 8 rows: ~3.8, but 128 registers), 64-74 registers; the step's 128 x words
    stay under the 256 threads (see _load_x). A step keeps 256 bytes a row in flight: at
    Moonlight's batch 1, 6 x 2816 / 64 = 264 gate/up programs (16 warps an SM, all resident)
    hold ~32 KB an SM, about what the H200's bandwidth times its latency asks; down's 192
    programs split K in two."""
    block_k = 512 if bits == 4 else 256  # 256 bytes a row a step either way
    return {"BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 8, "num_stages": 1, "SPLIT_TARGET": 16}


def _splits(programs: int, wanted: int, steps: int) -> tuple[int, int]:
    """(splits, steps a split) for programs * splits to reach `wanted` programs, as far as K's
    steps go; no split is empty."""
    want = min(triton.cdiv(wanted, programs), steps) if programs < wanted else 1
    per_split = triton.cdiv(steps, want)
    return triton.cdiv(steps, per_split), per_split


def _pair_grid(
    name: str,
    least_k: int,
    a: torch.Tensor,
    n_rows: int,
    n_out: int,
    num_pairs: int,
    gated: bool,
    config: dict[str, Any],
    warps: int,
    sms: int,
    out_dtype: torch.dtype,
) -> tuple[int, int, int, torch.Tensor]:
    """A pair GEMV's grid and output, for the INT and FP8 kernels alike: (programs, splits,
    steps a split, out), out h [1, P, I] in out_dtype (gated, K whole) or fp32 sums
    [splits, P, N]. BLOCK_K a power of two >= least_k, BLOCK_N a power of two >= 2."""
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    if block_k & (block_k - 1) or block_k < least_k or block_n & (block_n - 1) or block_n < 2:
        raise ValueError(
            f"{name}: BLOCK_K {block_k} must be a power of two >= {least_k}, BLOCK_N "
            f"{block_n} a power of two >= 2"
        )
    programs = triton.cdiv(n_rows, block_n) * num_pairs
    wanted = config.get("SPLIT_TARGET", 16) * sms // warps
    splits, steps = _splits(programs, wanted, triton.cdiv(a.shape[1], block_k))
    if splits > 1 or not gated:
        out = torch.empty(splits, num_pairs, n_rows, dtype=torch.float32, device=a.device)
    else:
        out = torch.empty(1, num_pairs, n_out, dtype=out_dtype, device=a.device)
    return programs, splits, steps, out


def _packed_rows(a: torch.Tensor) -> tuple[torch.Tensor, int]:
    """a as int64 words of four values and the kernel's X_PACKED (1 bf16, 2 fp16), where a is
    16-bit with rows of whole, aligned words; else (a, 0): x read element by element."""
    kind = {torch.bfloat16: 1, torch.float16: 2}.get(a.dtype, 0)
    words = a.stride(1) == 1 and a.shape[1] % 4 == 0 and a.stride(0) % 4 == 0
    if kind and words and a.data_ptr() % 8 == 0:
        return a.view(torch.int64), kind
    return a, 0


def _gemv(
    a: torch.Tensor,
    w: ExpertWeights,
    experts: torch.Tensor,
    gated: bool,
    config: dict[str, Any],
    sms: int,
    foreign: bool = False,
) -> tuple[torch.Tensor, int]:
    """One projection of every pair: h [P, I] (gated, K whole) or fp32 sums [splits, P, N]."""
    num_pairs = experts.numel()
    n_rows, k_in = w.data.shape[1], a.shape[1]
    n_out = n_rows // 2 if gated else n_rows
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    warps = config.get("num_warps", 8)
    programs, splits, steps, out = _pair_grid(
        "fused_moe_int", 32, a, n_rows, n_out, num_pairs, gated, config, warps, sms, a.dtype
    )
    partial = splits > 1 or not gated
    zero = w.zero if w.zero is not None else w.scale  # a placeholder the kernel never reads
    a_words, x_packed = _packed_rows(a)
    _moe_gemv_int_kernel[(programs, splits)](
        a_words,
        w.data,
        w.scale,
        zero,
        experts,
        out,
        num_pairs,
        experts.shape[1],
        w.data.shape[0],
        n_out,
        k_in,
        w.data.shape[2],
        w.scale.shape[2],
        steps,
        a_words.stride(0),
        *experts.stride(),
        *w.data.stride()[:2],
        *w.scale.stride(),
        *(zero.stride() if w.zero is not None else (0, 0, 0)),
        *out.stride()[:2],
        MAGIC,
        HALF_SHIFT,
        X_PACKED=x_packed,
        GATED=gated,
        PARTIAL=partial,
        FOREIGN=foreign,
        BITS=w.bits,
        GROUP=0 if w.group >= k_in else w.group,
        HAS_ZERO=w.zero is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k_in % block_k == 0,
        STAGES=config.get("num_stages", 1),
        num_warps=warps,
    )
    return (out if partial else out[0]), splits


def moe_int_decode(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    weights: torch.Tensor,
    experts: torch.Tensor,
    config: dict[str, Any] | None = None,
    foreign: bool = False,
) -> torch.Tensor:
    """fused_moe_int's path at up to UNSORTED_MAX_TOKENS tokens (its checks done): x [T, H];
    w13, w2 the packed projections; weights, experts [T, k] and `foreign` as fused_moe's;
    config as decode_config_int's.
    Two or three launches, or four where gate/up's K is split; fixed shapes, no host sync."""
    t, hidden = x.shape
    top_k = experts.shape[1]
    inter = w13.data.shape[1] // 2
    if t == 0 or top_k == 0:
        return torch.zeros_like(x)
    config = config or decode_config_int(w13.bits)
    up_config = {k: v for k, v in config.items() if k != "down"}
    down_config = {**up_config, **config.get("down", {})}
    sms = num_sms(x) if x.is_cuda else DEFAULT_SMS
    h, splits = _gemv(x, w13, experts, True, up_config, sms, foreign)
    h = _gate_up(h, splits, inter, x.dtype)
    part, splits = _gemv(h, w2, experts, False, down_config, sms, foreign)
    return _down_sum(part, splits, weights, experts, w13.data.shape[0], x, foreign)


def _gate_up(h: torch.Tensor, splits: int, inter: int, dtype: torch.dtype) -> torch.Tensor:
    """h [P, I] as the gate/up GEMV left it, or, where it split K (fp32 sums [splits, P, 2I]),
    the splits' gate and up sums added, then silu(gate) * up: one launch."""
    if h.dim() != 3:
        return h
    part = h
    h = torch.empty(part.shape[1], inter, dtype=dtype, device=part.device)
    block = 256
    _gate_up_sum_kernel[(triton.cdiv(inter, block), part.shape[1])](
        part, h, inter, splits, part.stride(0), part.stride(1), h.stride(0), BLOCK=block
    )
    return h


def _down_sum(
    part: torch.Tensor,
    splits: int,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    x: torch.Tensor,
    foreign: bool,
) -> torch.Tensor:
    """The down projection's fp32 sums [splits, P, H] into [T, H] in x's dtype, with
    fused_moe's rounding (_down_sum_kernel): one launch."""
    t, hidden = x.shape
    top_k = experts.shape[1]
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    block = 512
    _down_sum_kernel[(triton.cdiv(hidden, block), t)](
        part,
        weights,
        experts,
        out,
        hidden,
        splits,
        num_experts,
        part.stride(0),
        part.stride(1),
        *weights.stride(),
        *experts.stride(),
        out.stride(0),
        TOP_K=top_k,
        FOREIGN=foreign,
        BLOCK=block,
    )
    return out


def moe_fp8_decode(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    weights: torch.Tensor,
    experts: torch.Tensor,
    config: dict[str, Any] | None = None,
    foreign: bool = False,
) -> torch.Tensor:
    """fused_moe_fp8's path at up to UNSORTED_MAX_TOKENS tokens (its checks done): W8A8 as the
    grouped GEMM (x, then h, quantized per group of the block's width, one launch each), each
    (token, expert) pair on the CUDA cores (fp8_gemv's loop); config as decode_config_fp8's.
    Four to six launches; fixed shapes, no host sync."""
    t = x.shape[0]
    top_k = experts.shape[1]
    inter = w13.data.shape[1] // 2
    if t == 0 or top_k == 0:
        return torch.zeros_like(x)
    config = config or decode_config_fp8()
    up_config = {k: v for k, v in config.items() if k != "down"}
    down_config = {**up_config, **config.get("down", {})}
    sms = num_sms(x) if x.is_cuda else DEFAULT_SMS
    a, a_scale = quantize_fp8_groups(x, w13.group)
    h, splits = _gemv_fp8(a, a_scale, w13, experts, True, up_config, sms, x.dtype, foreign)
    h = _gate_up(h, splits, inter, x.dtype)
    a, a_scale = quantize_fp8_groups(h, w2.group)
    part, splits = _gemv_fp8(a, a_scale, w2, experts, False, down_config, sms, x.dtype, foreign)
    return _down_sum(part, splits, weights, experts, w13.data.shape[0], x, foreign)


def decode_config_fp8() -> dict[str, Any]:
    """The FP8 experts' CUDA-core path's tunables (both projections; a "down" dict, if any,
    overrides some for the down projection), as decode_config_int's. Swept on an H200 at Kimi
    K2's experts (benchmarks/probes/fp8_decode_sweep.py, fp8_decode_sweep-H200-2026-12-02.json):
    8 rows a program over one warp, 1,024 of K a step (two 16-byte chunks a thread), took 97.8
    us for a token's 8 experts (352 MB) and 171.6 for two tokens', against 342.6 and 435.1 on
    the grouped GEMM's 16-row tensor-core tiles; 16 rows over 2 warps 105.6 and 184.8."""
    return {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 1, "num_stages": 1, "SPLIT_TARGET": 16}


def _gemv_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: ExpertWeights,
    experts: torch.Tensor,
    gated: bool,
    config: dict[str, Any],
    sms: int,
    out_dtype: torch.dtype,
    foreign: bool = False,
) -> tuple[torch.Tensor, int]:
    """One FP8 projection of every pair, a its e4m3 codes with scales a_scale: h [P, I] in
    out_dtype (gated, K whole) or fp32 sums [splits, P, N]."""
    num_pairs = experts.numel()
    n_rows, k_in = w.data.shape[1], a.shape[1]
    n_out = n_rows // 2 if gated else n_rows
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    warps = config.get("num_warps", 2)
    programs, splits, steps, out = _pair_grid(
        "fused_moe_fp8", 16, a, n_rows, n_out, num_pairs, gated, config, warps, sms, out_dtype
    )
    partial = splits > 1 or not gated
    _moe_gemv_fp8_kernel[(programs, splits)](
        a,
        a_scale,
        w.data,
        w.scale,
        experts,
        out,
        num_pairs,
        experts.shape[1],
        w.data.shape[0],
        n_out,
        k_in,
        steps,
        a.stride(0),
        a_scale.stride(0),
        *experts.stride(),
        *w.data.stride()[:2],
        *w.scale.stride(),
        *out.stride()[:2],
        GATED=gated,
        PARTIAL=partial,
        FOREIGN=foreign,
        SCALE_ROWS=w.block_n,
        GROUP=w.group,
        STEP=w.group < k_in,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k_in % block_k == 0,
        STAGES=config.get("num_stages", 1),
        num_warps=warps,
    )
    return (out if partial else out[0]), splits
