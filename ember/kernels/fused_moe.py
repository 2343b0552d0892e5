"""Fused mixture-of-experts (Triton): a grouped GEMM over the (token, expert) pairs sorted by expert.

`align_by_expert` lays the T * k routed pairs out expert by expert, each expert's run padded to a
whole number of BLOCK_M rows, and names each block's expert. The grouped GEMM then runs one
program per (block, column tile): it reads its expert's weight tile and multiplies it by the
block's rows, gathered from the tokens in place, so no permuted copy of the activations is made.
Two launches make an expert MLP:

1. gate/up: h[p] = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T) for pair p = (t, e). The
   program keeps a gate and an up accumulator for the same columns and writes only h [T * k, I]:
   the SiLU-and-mul is fused into the epilogue, saving a write and read of [T * k, 2I].
2. down: y[p] = weight[p] * (h[p] @ w2[e].T), the routing weight applied in the epilogue, written
   k-major ([k, T, H]); the k slabs are then summed (deterministic, unlike atomic adds).

Everything, routing included (ember/kernels/moe_routing.py), is fixed-shape kernels with no host
sync, so the whole MoE layer is captured in CUDA graphs. The reference is FusedMoE's per-expert loop
(ember/models/layers/moe.py).

Quantized experts take the same kernel, the weight kind a constexpr (`fused_moe_int`,
`fused_moe_fp8`): packed INT4/INT8 with group scales (compressed-tensors pack-quantized, Kimi
K2.5's routed experts) are dequantized tile by tile in registers to the activations' dtype
(W4A16); FP8 experts with 128 x 128 block scales (DeepSeek-V3, Kimi K2) multiply fp8 weights by
activations quantized to fp8 per token group of 128 in the K loop (W8A8), both scales applied to
the fp32 accumulator. Symmetric INT4 with 16-bit scales (Kimi K2.5's) unpacks two weights an
instruction (`_int4_tile`: lop3 into bf16x2 / fp16x2 with a magic exponent, one fma for the bias
and one for a pair of scales, the same bits as the general unpacking) and reads its scales as
int32 words, so that they pipeline with the weights. The formats and their reference math are in
ember/kernels/quant_ref.py. Packed INT and FP8 experts at up to UNSORTED_MAX_TOKENS tokens take a CUDA-core GEMV a pair
instead (ember/kernels/fused_moe_decode.py).

The two numbers, per layer and step: bytes ~= (experts hit) * 3 * H * I * itemsize of weights plus
the activations; flops = 6 * T * k * H * I. At decode batch 1 only k experts are read (memory
bound); at batch 256 of a 128-expert model every expert is hit by ~16 rows, still under the ~300
flops per byte where an H100 turns compute bound, so the weights' bytes set the floor there too.

Expert parallel (`foreign=True`): a rank holds E of the model's experts, and its layer maps each
route to local ids, E for an expert another rank holds. Such a pair is skipped and adds nothing:
the unsorted path's block and the sorted path's run of id E stop at the GEMM's
`expert >= num_experts` test before any weight is read, the down projection's rows start at zero,
and the INT decode path's GEMVs return at once and its sum leaves the pair out. Without `foreign`
the kernels compile and run as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ember.kernels.dispatch import dot_precision
from ember.kernels.fp8_gemm import _fp8_bits, quantize_fp8_groups, supports_fp8
from ember.kernels.fused_moe_decode import moe_fp8_decode, moe_int_decode
from ember.kernels.quant_ref import FP8_MAX, FP8_SCALE_EPS, per_word

UNSORTED_MAX_TOKENS = 2
"""Up to this many tokens the pairs are not sorted: each pair is its own block of the grouped GEMM
(its expert read from the routing), which saves the alignment's five launches (~6 us of a
Moonlight layer's ~130 at batch 1 on an H200). A token's k experts are distinct, so at batch 1
every weight is read once either way; at two tokens an expert both chose is read twice (from L2
when the two blocks run together). Past that, sorting pays: the rows of an expert share its tiles.
Packed INT and FP8 experts take ember/kernels/fused_moe_decode.py's GEMVs up to this many
tokens."""


# Sizes that change from batch to batch (and pointers into sliced tensors) do not specialize:
# one compiled variant serves every batch, so none is compiled on the request path.
@triton.jit(do_not_specialize=["n"])
def _count_kernel(experts_ptr, counts_ptr, rank_ptr, n, BLOCK: tl.constexpr):
    # Each pair's rank among its expert's pairs is the count before it: the atomic's old value.
    # The order within an expert is arbitrary but harmless: every row of the GEMM is computed
    # on its own, so a pair's output does not depend on where in its expert's run it sits.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    e = tl.load(experts_ptr + offs, mask=ok, other=0)
    rank = tl.atomic_add(counts_ptr + e, 1, mask=ok, sem="relaxed")
    tl.store(rank_ptr + offs, rank, mask=ok)


@triton.jit(do_not_specialize=["max_blocks"])
def _runs_kernel(
    counts_ptr,
    run_start_ptr,
    block_experts_ptr,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # One program: each expert's run padded to whole blocks, the runs' starts, each block's expert.
    es = tl.arange(0, BLOCK_E)
    real = es < num_experts
    counts = tl.load(counts_ptr + es, mask=real, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(run_start_ptr + es, ends - padded, mask=real)
    for b0 in range(0, max_blocks, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        # A block's expert is the number of runs that end at or before its first row; past the
        # last run that is num_experts, which the GEMM skips.
        done = (ends[None, :] <= (bs * BLOCK_M)[:, None]) & real[None, :]
        tl.store(block_experts_ptr + bs, tl.sum(done.to(tl.int32), axis=1), mask=bs < max_blocks)


@triton.jit(do_not_specialize=["n"])
def _place_kernel(experts_ptr, rank_ptr, run_start_ptr, pairs_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    e = tl.load(experts_ptr + offs, mask=ok, other=0)
    rank = tl.load(rank_ptr + offs, mask=ok, other=0)
    dest = tl.load(run_start_ptr + e, mask=ok, other=0) + rank
    tl.store(pairs_ptr + dest, offs, mask=ok)


def align_by_expert(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the routed pairs by expert, each expert's run padded to a multiple of block_m.

    experts: [T, k] expert ids. Returns (sorted_pairs, block_experts): sorted_pairs [P] holds flat
    pair indices t * k + j (padding holds T * k, which the kernel masks), block_experts [P / block_m]
    the expert of each block, num_experts for blocks past the last expert's run (skipped).
    P = min(T * k, blocks) * block_m is a function of the shapes only, so the result is graph safe:
    every non-empty expert takes at least one block, so at most T * k blocks are used.
    Three small Triton launches (count, runs, place) after two fills: the torch-op version of the
    same (bincount by scatter, stable argsort, cumsums, searchsorted) took ~15 launches and
    38-138 us of GPU time on an H200, a fifth of a batch-256 MoE layer.
    """
    flat = experts.reshape(-1).to(torch.int32)
    n = flat.numel()
    device = flat.device
    max_blocks = min(n, triton.cdiv(n + num_experts * (block_m - 1), block_m))
    sorted_pairs = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    if n == 0:
        return sorted_pairs, block_experts
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    run_start = torch.empty(num_experts, dtype=torch.int32, device=device)
    block = 1024
    _count_kernel[(triton.cdiv(n, block),)](flat, counts, rank, n, BLOCK=block)
    block_e = triton.next_power_of_2(num_experts)
    _runs_kernel[(1,)](
        counts,
        run_start,
        block_experts,
        num_experts,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_B=max(16, 8192 // block_e),
    )
    _place_kernel[(triton.cdiv(n, block),)](flat, rank, run_start, sorted_pairs, n, BLOCK=block)
    return sorted_pairs, block_experts


DENSE, PACKED_INT, FP8_BLOCK = 0, 1, 2
"""The experts' weight kinds, a constexpr of the grouped GEMM: each compiles only its own loads."""

_DENSE: tl.constexpr = tl.constexpr(DENSE)
_PACKED_INT: tl.constexpr = tl.constexpr(PACKED_INT)
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_FP8_SCALE_EPS: tl.constexpr = tl.constexpr(FP8_SCALE_EPS)


@triton.jit
def _int_tile(
    w_ptrs,
    w_ok,
    s_ptrs,
    z_ptrs,
    s_ok,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    OUT: tl.constexpr,
    SPT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # w_ptrs [BLOCK_N, BLOCK_K * BITS / 32]: the tile's packed words; s_ptrs / z_ptrs
    # [BLOCK_N, SPT]: its SPT scale groups. Returns the real weights [BLOCK_N, BLOCK_K] in OUT.
    words = tl.load(w_ptrs, mask=w_ok, other=0)
    scale_in = tl.load(s_ptrs, mask=s_ok, other=0.0)
    scale = scale_in.to(tl.float32)
    if HAS_ZERO:  # noqa: SIM108 (a constexpr branch: the symmetric build loads no zeros)
        zero = tl.load(z_ptrs, mask=s_ok, other=0).to(tl.float32)
    else:
        zero = tl.zeros_like(scale)
    # Each 16-bit half of a word holds R fields, field j at bit BITS * j. The half ORed with
    # 2**23's bits, then ANDed with field j's mask (plus those bits), is the float
    # 2**23 + f * 2**(BITS * j): about one LOP3 a weight, with no shift and no int-to-float
    # conversion (16 a clock per SM on sm_90, an eighth of fp32 math: slower than HBM feeds
    # INT4 weights). Subtracting 2**23 + (2**(BITS-1) + zero) * 2**(BITS * j) is exact, and so is
    # scale * 2**-(BITS * j), so one rounding (the product's) remains, as in the reference.
    # Joins keep a half's R copies in one thread's registers (a broadcast spreads them over
    # threads); words load [BLOCK_N, BLOCK_K * BITS / 32], rows whole, so loads coalesce and the
    # dequantized tile is stored K-contiguous, 16 bytes at a time. (The join also makes Triton
    # pick kWidth 4 for the dot operands.) Offline sm_90 builds: ~7 SASS instructions a weight
    # in the decode tiles' K loop, 9-10 for a shift-and-mask unpack.
    R: tl.constexpr = 16 // BITS
    halves = tl.interleave(words, words >> 16) | 0x4B000000  # [BLOCK_N, BLOCK_K / R]
    x = tl.join(halves, halves)
    if R == 4:
        x = tl.join(x, x)
    x = tl.reshape(x, (BLOCK_N, SPT, BLOCK_K // SPT // R, R))
    j = tl.arange(0, R)
    f = (x & ((((1 << BITS) - 1) << (j * BITS)) | 0x4B000000)[None, None, None, :]).to(
        tl.float32, bitcast=True
    )
    step = (1 << (j * BITS)).to(tl.float32)[None, None, None, :]
    bias = 8388608.0 + ((1 << (BITS - 1)) + zero)[:, :, None, None] * step
    w = (f - bias) * (scale[:, :, None, None] * (1.0 / step))
    # Rounded to the scale's dtype, then to x's, as the reference (one cast when they agree).
    return tl.reshape(w.to(scale_in.dtype).to(OUT), (BLOCK_N, BLOCK_K))


# INT4 two weights an instruction (`_int4_fields`): a 16-bit half of (word >> 4i) & 0x000F000F
# or-ed with the bits of 128 (bf16) or 1024 (fp16) is that float plus the field, exactly: its
# ulp there is 1. Operands of the PTX below: $0-$7 the eight fields (16-bit registers), $8 the
# word, $9 the scale twice (a bf16x2 / f16x2); one LOP3 (and a shift) a pair of weights, an
# FMA taking off 128 + 8 (or 1024 + 8), exact, and one multiplying by the scale, rounded once
# as the reference rounds: two instructions a weight, where Triton's elementwise ops handle
# one 16-bit value at a time. fma with -0.0 is a correctly rounded multiply on sm_80 and up
# (mul.bf16x2 needs sm_90).
_INT4_PAIRS_PTX = """{
.reg .b32 t0, t1, t2, t3, u, one, bias, nz;
mov.b32 one, ONE;
mov.b32 bias, BIAS;
mov.b32 nz, 0x80008000;
lop3.b32 t0, $8, 0x000F000F, MAGIC, 0xEA;
shr.u32 u, $8, 4;
lop3.b32 t1, u, 0x000F000F, MAGIC, 0xEA;
shr.u32 u, $8, 8;
lop3.b32 t2, u, 0x000F000F, MAGIC, 0xEA;
shr.u32 u, $8, 12;
lop3.b32 t3, u, 0x000F000F, MAGIC, 0xEA;
fma.rn.TY t0, t0, one, bias;
fma.rn.TY t1, t1, one, bias;
fma.rn.TY t2, t2, one, bias;
fma.rn.TY t3, t3, one, bias;
fma.rn.TY t0, t0, $9, nz;
fma.rn.TY t1, t1, $9, nz;
fma.rn.TY t2, t2, $9, nz;
fma.rn.TY t3, t3, $9, nz;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}"""
_INT4_BF16_MAGIC = 0x4300  # 128.0 in bf16; 0x4308 is 136.0, 0x3F80 1.0
_INT4_F16_MAGIC = 0x6400  # 1024.0 in fp16; 0x6408 is 1032.0, 0x3C00 1.0
_PAIRS_BF16: tl.constexpr = tl.constexpr(
    _INT4_PAIRS_PTX.replace("TY", "bf16x2")
    .replace("MAGIC", "0x43004300")
    .replace("ONE", "0x3F803F80")
    .replace("BIAS", "0xC308C308")
)
_PAIRS_F16: tl.constexpr = tl.constexpr(
    _INT4_PAIRS_PTX.replace("TY", "f16x2")
    .replace("MAGIC", "0x64006400")
    .replace("ONE", "0x3C003C00")
    .replace("BIAS", "0xE408E408")
)
_MAGIC_BF16: tl.constexpr = tl.constexpr(_INT4_BF16_MAGIC)
_MAGIC_F16: tl.constexpr = tl.constexpr(_INT4_F16_MAGIC)


@triton.jit
def _int4_fields(words, half, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """The eight INT4 fields of each word, each (q - 8) * s in DTYPE (bf16 or fp16), as eight
    tensors shaped like words: field j of word w is element 8w + j of a row. half: the scale's
    16 bits in an int32 (broadcast). ASM: the PTX above; otherwise the same bits in Triton's ops
    (Triton's interpreter)."""
    IS_BF16: tl.constexpr = tl.bfloat16 == DTYPE
    if ASM:
        return tl.inline_asm_elementwise(
            _PAIRS_BF16 if IS_BF16 else _PAIRS_F16,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            [words, half | (half << 16)],
            dtype=(DTYPE.value,) * 8,
            is_pure=True,
            pack=1,
        )
    else:
        s = half.to(tl.int16).to(DTYPE, bitcast=True)
        MAGIC: tl.constexpr = _MAGIC_BF16 if IS_BF16 else _MAGIC_F16
        BIAS: tl.constexpr = 136.0 if IS_BF16 else 1032.0
        magic = MAGIC | (MAGIC << 16)
        t0 = (words & 0x000F000F) | magic
        t1 = ((words >> 4) & 0x000F000F) | magic
        t2 = ((words >> 8) & 0x000F000F) | magic
        t3 = ((words >> 12) & 0x000F000F) | magic
        return (
            ((t0 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
            ((t1 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
            ((t2 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
            ((t3 & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
            ((t0 >> 16).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
            ((t1 >> 16).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
            ((t2 >> 16).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
            ((t3 >> 16).to(tl.int16).to(DTYPE, bitcast=True) - BIAS) * s,
        )


@triton.jit
def _int4_tile(
    w_ptrs,
    w_ok,
    s_rows,
    s_sk,
    col_ok,
    g0,
    k_groups,
    DTYPE: tl.constexpr,
    ASM: tl.constexpr,
    SPT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # As _int_tile for symmetric INT4 with scales in x's 16-bit dtype (Kimi K2.5's experts),
    # two weights an instruction (_int4_fields): [BLOCK_N, BLOCK_K] in DTYPE. s_rows [BLOCK_N,
    # 1]: the rows' scales as int32 words, two a word, from group g0 on. Loaded 4 bytes at a
    # time they go through Triton's software pipeline like the weights' words; loaded 2 bytes
    # at a time they did not, and each K step waited out their latency.
    words = tl.load(w_ptrs, mask=w_ok, other=0)
    if SPT >= 2:  # SPT groups a step, from an even one: SPT / 2 words of scales
        sw = g0 // 2 + tl.arange(0, SPT // 2)
        pair = tl.load(
            s_rows + sw[None, :] * s_sk, mask=col_ok[:, None] & (2 * sw < k_groups)[None, :]
        )
        half = tl.reshape(tl.join(pair & 0xFFFF, (pair >> 16) & 0xFFFF), (BLOCK_N, SPT))
    else:  # a group spans the step: one scale, the low or high half of its word
        pair = tl.load(s_rows + (g0 // 2) * s_sk, mask=col_ok[:, None] & (g0 < k_groups))
        half = (pair >> ((g0 % 2) * 16)) & 0xFFFF
    words = tl.reshape(words, (BLOCK_N, SPT, BLOCK_K // SPT // 8))
    f0, f1, f2, f3, f4, f5, f6, f7 = _int4_fields(words, half[:, :, None], DTYPE, ASM)
    # Three joins put field j of word w at 8w + j (the first join's index is j's bit of 4, the
    # last's its bit of 1), a word's eight fields in one thread's registers.
    b0 = tl.join(tl.join(f0, f4), tl.join(f2, f6))
    b1 = tl.join(tl.join(f1, f5), tl.join(f3, f7))
    return tl.reshape(tl.join(b0, b1), (BLOCK_N, BLOCK_K))


@triton.jit
def _quantize_rows(a, HW_CAST: tl.constexpr):
    # The tile's rows are whole activation groups (BLOCK_K == the group): per-row amax, one
    # float32 scale a row, values to e4m3 with quant_ref.quantize_fp8_groups' fp32 ops (correctly
    # rounded divisions, as fp8_gemm's quantizer), so its bits.
    af = a.to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(af), axis=1), _FP8_SCALE_EPS), _FP8_MAX)
    v = tl.div_rn(af, tl.broadcast_to(scale[:, None], af.shape))
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    return _fp8_bits(v, HW_CAST).to(tl.float8e4nv, bitcast=True), scale


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weight_ptr,
    pairs_ptr,
    block_expert_ptr,
    s_ptr,
    z_ptr,
    as_ptr,
    num_pairs,
    num_experts,
    n_out,
    k_in,
    k_words,
    k_groups,
    a_sm,
    a_sk,
    b_se,
    b_sn,
    b_sk,
    c_sm,
    c_sn,
    s_se,
    s_sn,
    s_sk,
    z_se,
    z_sn,
    z_sk,
    as_sm,
    num_blocks,
    ROWS_PER_A: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    K_MAJOR_OUT: tl.constexpr,
    PRECISION: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    SPT: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    INT4_PAIRS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_SN: tl.constexpr,
    HW_CAST: tl.constexpr,
    A_FP8: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # KIND picks how the weight tile is read (see _ExpertWeights); everything else is shared.
    # PACKED_INT: b is int32 words [E, N, k_words], s/z [E, N, k_groups], GROUP elements of K a
    # scale, SPT scale groups a K tile. FP8_BLOCK: b is e4m3 [E, N, K], s [E, N / BLOCK_SN,
    # K / BLOCK_K]: BLOCK_K is the block's (and the activation group's) width. A_FP8: a is
    # already e4m3, its scales at as_ptr [rows, K / BLOCK_K]; otherwise a is quantized here.
    # SWAP_AB (FP8_BLOCK): each dot is W x^T, [BLOCK_N, BLOCK_M], so that a few rows an expert
    # sit in the MMA's narrow side: on sm_90 an fp8 wgmma (64+ weight rows by 16 token columns)
    # where x W^T with 16 token rows is an mma.sync with every fp8 weight unpacked to fp16.
    # Grouped launch order: GROUP_M row blocks (usually one expert's) sweep the column tiles
    # together, so an expert's weight tile is fetched from HBM once and served from L2 after.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n_out, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    if PAIR_BLOCKS:
        # Unsorted: block b is pair b alone (row 0; tl.dot wants 16 rows, the rest are masked),
        # its expert read from the routing itself.
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    offs_k = tl.arange(0, BLOCK_K)

    a_base = a_ptr + a_rows[:, None] * a_sm
    b_base = b_ptr + expert.to(tl.int64) * b_se + cols[None, :].to(tl.int64) * b_sn
    if SWAP_AB:
        b_base_t = b_ptr + expert.to(tl.int64) * b_se + cols[:, None].to(tl.int64) * b_sn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if KIND == _PACKED_INT:
        per_word: tl.constexpr = 32 // BITS
        spt = tl.arange(0, SPT)
        tile_words = tl.arange(0, BLOCK_K // per_word)
        w_rows = b_ptr + expert.to(tl.int64) * b_se + cols[:, None].to(tl.int64) * b_sn
        s_rows = s_ptr + expert.to(tl.int64) * s_se + cols[:, None].to(tl.int64) * s_sn
        z_rows = z_ptr + expert.to(tl.int64) * z_se + cols[:, None].to(tl.int64) * z_sn
    elif KIND != _DENSE:
        # A weight block's scale a column: the gate and up rows of a block never straddle.
        s_cols = s_ptr + expert.to(tl.int64) * s_se + (cols // BLOCK_SN).to(tl.int64) * s_sn
        s_cols_up = s_ptr + expert.to(tl.int64) * s_se + ((cols + n_out) // BLOCK_SN) * s_sn
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_in
        a = tl.load(a_base + ks[None, :] * a_sk, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if KIND == _DENSE:
            b_mask = k_ok[:, None] & col_ok[None, :]
            b = tl.load(b_base + ks[:, None] * b_sk, mask=b_mask, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                b_up = tl.load(b_base + n_out * b_sn + ks[:, None] * b_sk, mask=b_mask, other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        elif KIND == _PACKED_INT:
            words = k0 // per_word + tile_words
            w_ok = col_ok[:, None] & (words < k_words)[None, :]
            groups = (k0 + spt * (BLOCK_K // SPT)) // GROUP
            s_ok = col_ok[:, None] & (groups < k_groups)[None, :]
            w_ptrs = w_rows + words[None, :] * b_sk
            s_ptrs = s_rows + groups[None, :] * s_sk
            z_ptrs = z_rows + groups[None, :] * z_sk
            up_w, up_s, up_z = n_out * b_sn, n_out * s_sn, n_out * z_sn  # the up rows' offsets
            if INT4_PAIRS:
                DTYPE: tl.constexpr = a_ptr.dtype.element_ty
                g0 = k0 // GROUP
                b = _int4_tile(
                    w_ptrs,
                    w_ok,
                    s_rows,
                    s_sk,
                    col_ok,
                    g0,
                    k_groups,
                    DTYPE,
                    ASM,
                    SPT,
                    BLOCK_N,
                    BLOCK_K,
                )
                if GATED:
                    b_up = _int4_tile(
                        w_ptrs + up_w,
                        w_ok,
                        s_rows + up_s,
                        s_sk,
                        col_ok,
                        g0,
                        k_groups,
                        DTYPE,
                        ASM,
                        SPT,
                        BLOCK_N,
                        BLOCK_K,
                    )
            else:
                OUT: tl.constexpr = a_ptr.dtype.element_ty
                b = _int_tile(
                    w_ptrs, w_ok, s_ptrs, z_ptrs, s_ok, BITS, HAS_ZERO, OUT, SPT, BLOCK_N, BLOCK_K
                )
                if GATED:
                    b_up = _int_tile(
                        w_ptrs + up_w,
                        w_ok,
                        s_ptrs + up_s,
                        z_ptrs + up_z,
                        s_ok,
                        BITS,
                        HAS_ZERO,
                        OUT,
                        SPT,
                        BLOCK_N,
                        BLOCK_K,
                    )
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
            if GATED:
                acc_up = tl.dot(a, tl.trans(b_up), acc_up, input_precision=PRECISION)
        else:
            if A_FP8:  # quantized by fp8_gemm.quantize_fp8_groups, scales [rows, K / BLOCK_K]
                a_q = a
                a_scale = tl.load(as_ptr + a_rows * as_sm + k0 // BLOCK_K, mask=valid, other=0.0)
            else:
                a_q, a_scale = _quantize_rows(a, HW_CAST)
            k_block = k0 // BLOCK_K
            b_scale = tl.load(s_cols + k_block * s_sk, mask=col_ok, other=0.0)
            # A fresh dot a K tile, scaled into the fp32 accumulator: each tile has its own
            # scales, and sm_90's fp8 MMA accumulates in reduced precision within a dot.
            if SWAP_AB:
                a_t = tl.trans(a_q)
                b_mask = col_ok[:, None] & k_ok[None, :]
                b = tl.load(b_base_t + ks[None, :] * b_sk, mask=b_mask, other=0.0)
                acc += tl.dot(b, a_t) * (b_scale[:, None] * a_scale[None, :])
                if GATED:
                    b_up = tl.load(
                        b_base_t + n_out * b_sn + ks[None, :] * b_sk, mask=b_mask, other=0.0
                    )
                    b_scale = tl.load(s_cols_up + k_block * s_sk, mask=col_ok, other=0.0)
                    acc_up += tl.dot(b_up, a_t) * (b_scale[:, None] * a_scale[None, :])
            else:
                b_mask = k_ok[:, None] & col_ok[None, :]
                b = tl.load(b_base + ks[:, None] * b_sk, mask=b_mask, other=0.0)
                acc += tl.dot(a_q, b) * (a_scale[:, None] * b_scale[None, :])
                if GATED:
                    b_up = tl.load(
                        b_base + n_out * b_sn + ks[:, None] * b_sk, mask=b_mask, other=0.0
                    )
                    b_scale = tl.load(s_cols_up + k_block * s_sk, mask=col_ok, other=0.0)
                    acc_up += tl.dot(a_q, b_up) * (a_scale[:, None] * b_scale[None, :])

    if SWAP_AB:
        acc = tl.trans(acc)
        if GATED:
            acc_up = tl.trans(acc_up)
    if GATED:
        # As silu_and_mul: each projection rounded to the activations' dtype, silu(gate) rounded
        # again before the multiply, so bf16 results match the unfused reference.
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(c_ptr.dtype.element_ty)
        acc = act.to(tl.float32) * up
    if MUL_WEIGHT:
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        # The routing weight rounded to the activations' dtype first, as the reference multiplies.
        w = tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(c_ptr.dtype.element_ty)
        acc = acc * w.to(tl.float32)[:, None]
    if K_MAJOR_OUT:  # pair t * k + j to row j * T + t: the top-k sum then adds k whole slabs
        out_rows = (pairs % K_MAJOR_OUT) * (num_pairs // K_MAJOR_OUT) + pairs // K_MAJOR_OUT
    else:
        out_rows = pairs
    c = c_ptr + out_rows[:, None].to(tl.int64) * c_sm + cols[None, :] * c_sn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _sum_slabs_kernel(y_ptr, out_ptr, n, NUM_SLABS: tl.constexpr, BLOCK: tl.constexpr):
    # out[i] = sum_j y[j * n + i], in fp32 and rounded once, as torch.sum over the first dim.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # k * T * H may pass 2**31
    ok = offs < n
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(NUM_SLABS):
        acc += tl.load(y_ptr + j * n + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_slabs(y: torch.Tensor) -> torch.Tensor:
    """y [k, T, H] contiguous summed over k: one launch of ~1 us where torch's reduction over the
    first dim took ~5 us at decode sizes on an H200 (its generic reduce kernel), every layer."""
    k, t, hidden = y.shape
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    n = t * hidden
    if n:
        block = 1024
        _sum_slabs_kernel[(triton.cdiv(n, block),)](y, out, n, NUM_SLABS=k, BLOCK=block)
    return out


def tile_config(num_pairs: int, num_experts: int) -> dict[str, int]:
    """Tile sizes by rows per expert, the fastest of benchmarks/probes/moe_kernel.py's sweep on an H200
    at the Moonlight and Qwen3-30B expert dims: decode-sized batches (a few rows an expert) are
    bound by the weights' bytes, so small row blocks and long K tiles keep many loads in flight;
    prefill-sized ones are bound by the tensor cores and take 128 x 128 tiles over 8 warps."""
    per_expert = num_pairs / num_experts
    if per_expert < 12:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def tile_config_int(
    num_pairs: int, num_experts: int, bits: int, pairs: bool = False
) -> dict[str, int]:
    """Tile sizes for packed INT experts (W4A16 / W8A16), by rows per expert; `pairs`: INT4 read
    two weights an instruction (`int4_pairs`).

    The pairs' tiles were swept on an H200 at Moonlight's expert dims (64 experts, top 6; see
    benchmarks/probes/moe_int_batches.py): from 16 to 256 tokens 64-row wgmma tiles of 64
    columns won (16 tokens: 256 us against 306 on 16 x 32 x 256 mma.sync tiles, 64 tokens: 312
    against 367), even with most of their rows empty: dequantizing, once a weight whatever the
    rows, sets the time, and wgmma takes the dot off the warps' issue slots. At 1,024 tokens
    128 x 128 x 64 over 8 warps won (469 us; 64 x 64 x 128: 568).

    The general unpacking (INT8, zero points, fp32 scales) keeps tiles checked only by offline
    sm_90 builds (no spills, <= 188 registers): few rows an expert, narrow column tiles (Moonlight
    at batch 1: 8 pairs x 1408 / 32 = 352 gate/up programs, 512 down) and K tiles of 128 bytes a
    row keep loads in flight; many rows, the tensor cores' tiles.
    """
    per_expert = num_pairs / num_experts
    if pairs and per_expert <= 64:
        if per_expert < 12:
            return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if per_expert < 12:
        block_k = 256 if bits == 4 else 128
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 4}
    if per_expert <= 64:
        block_k = 128 if bits == 4 else 64  # int8 at 128 spills
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def tile_config_fp8(num_pairs: int, num_experts: int, block: tuple[int, int]) -> dict[str, int]:
    """Tile sizes for FP8 block experts, by rows per expert; BLOCK_K is the block's width (each
    K tile one scale per row and column). Swept on an H200 at Kimi K2's expert dims (384
    experts, top 8; benchmarks/probes/moe_fp8_batches.py): up to ~12 rows an expert (Kimi K2 at
    16-1,024 tokens) 16-row tiles with SWAP_AB (each dot W x^T, an fp8 wgmma of 64 weight rows
    by 16 token columns) and 64 columns won (64 tokens: 2.91 ms for 12.5 GB, vLLM's Triton MoE
    2.87; 256 tokens: 3.99 against 4.58), 32 rows at 1,024 tokens (21 an expert: 4.35 ms
    against 64 x 128 over 8 warps' 5.06). The prefill tiles are the ones an offline sm_90
    build compiles without spills (two fp32 accumulators for gate and up: 128 x 128 over 8
    warps spills, 128 x 64 does not)."""
    per_expert = num_pairs / num_experts
    block_k = block[1]
    if per_expert < 12:
        return {
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "BLOCK_K": block_k,
            "num_warps": 4,
            "num_stages": 4,
            "SWAP_AB": 1,
        }
    if per_expert <= 64:
        return {
            "BLOCK_M": 32,
            "BLOCK_N": 128,
            "BLOCK_K": block_k,
            "num_warps": 4,
            "num_stages": 3,
            "SWAP_AB": 1,
        }
    return {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": block_k, "num_warps": 8, "num_stages": 4}


@dataclass(frozen=True, slots=True)
class _ExpertWeights:
    """One stacked expert projection [E, N, K] as the grouped GEMM reads it.

    DENSE: `data` [E, N, K] in the activations' dtype. PACKED_INT: `data` int32 [E, N, K * bits /
    32], `scale` [E, N, K / group], `zero` int8 like scale or None; `group` is K when channel-wise.
    FP8_BLOCK: `data` e4m3 [E, N, K], `scale` float32 [E, N / block_n, K / group] (ceil), `group`
    the block's width, which is also the activations' quantization group.
    """

    data: torch.Tensor
    kind: int = DENSE
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    bits: int = 0
    group: int = 0
    block_n: int = 1


def int4_pairs(b: _ExpertWeights, x_dtype: torch.dtype) -> bool:
    """Whether the grouped GEMM unpacks b two weights an instruction (`_int4_tile`): symmetric
    INT4 with contiguous scales in x's 16-bit dtype, an even number of groups a row (read two
    a word)."""
    return (
        b.kind == PACKED_INT
        and b.bits == 4
        and b.zero is None
        and b.scale is not None
        and b.scale.dtype == x_dtype
        and x_dtype in (torch.bfloat16, torch.float16)
        and b.scale.is_contiguous()
        and b.scale.shape[-1] % 2 == 0
    )


def _gemm(
    a: torch.Tensor,
    b: _ExpertWeights,
    c: torch.Tensor,
    weights: torch.Tensor | None,
    sorted_pairs: torch.Tensor | None,
    block_experts: torch.Tensor,
    rows_per_a: int,
    gated: bool,
    config: dict[str, int],
    k_major_out: int = 0,
    a_scale: torch.Tensor | None = None,
) -> None:
    n_out = c.shape[1]
    num_blocks = block_experts.numel()
    tiles_n = triton.cdiv(n_out, config["BLOCK_N"])
    k_in = a.shape[1]
    scale = b.scale if b.scale is not None else c  # a placeholder the kernel never reads
    zero = b.zero if b.zero is not None else scale
    spt = max(config["BLOCK_K"] // b.group, 1) if b.kind == PACKED_INT else 1
    config = dict(config)
    # config["INT4_PAIRS"] 0 keeps the general unpacking (to measure one against the other).
    pairs = config.pop("INT4_PAIRS", 1) == 1 and int4_pairs(b, a.dtype)
    swap_ab = config.pop("SWAP_AB", 0) == 1 and b.kind == FP8_BLOCK
    if pairs:  # the scales read as int32 words, two a word (_int4_tile)
        scale = scale.view(torch.int32)
    _moe_gemm_kernel[(num_blocks * tiles_n,)](
        a,
        b.data,
        c,
        weights if weights is not None else c,
        sorted_pairs if sorted_pairs is not None else block_experts,
        block_experts,
        scale,
        zero,
        a_scale if a_scale is not None else scale,
        c.shape[0],
        b.data.shape[0],
        n_out,
        k_in,
        b.data.shape[2],
        (b.scale if pairs else scale).shape[-1],  # groups a row, not the words that hold them
        *a.stride(),
        *b.data.stride(),
        *c.stride(),
        *(scale.stride() if b.scale is not None else (0, 0, 0)),
        *(zero.stride() if b.zero is not None else (0, 0, 0)),
        a_scale.stride(0) if a_scale is not None else 0,
        num_blocks,
        ROWS_PER_A=rows_per_a,
        PAIR_BLOCKS=sorted_pairs is None,
        GATED=gated,
        MUL_WEIGHT=weights is not None,
        K_MAJOR_OUT=k_major_out,
        PRECISION=dot_precision(a.dtype),
        KIND=b.kind,
        BITS=b.bits,
        GROUP=b.group,
        SPT=spt,
        HAS_ZERO=b.zero is not None,
        INT4_PAIRS=pairs,
        ASM=pairs and a.is_cuda,  # the PTX on a GPU, the same bits in Triton's ops elsewhere
        BLOCK_SN=b.block_n,
        # The e4m3 cast in integer ops where the hardware's is missing (Triton's interpreter).
        HW_CAST=b.kind == FP8_BLOCK and a.is_cuda,
        A_FP8=a_scale is not None,
        SWAP_AB=swap_ab,
        **{"GROUP_M": 8, **config},
    )


def _check_routing(
    name: str, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> None:
    t = x.shape[0]
    if weights.shape != experts.shape or experts.dim() != 2 or experts.shape[0] != t:
        raise ValueError(
            f"{name}: weights {tuple(weights.shape)} and experts {tuple(experts.shape)} "
            f"must both be [{t}, k]"
        )


def _moe(
    x: torch.Tensor,
    w13: _ExpertWeights,
    w2: _ExpertWeights,
    weights: torch.Tensor,
    experts: torch.Tensor,
    config: dict[str, int],
    act_group: int = 0,
    foreign: bool = False,
) -> torch.Tensor:
    """The two grouped GEMMs and the top-k sum, once the shapes are checked. act_group > 0: each
    GEMM's input is quantized to e4m3 first, per token group of act_group (one launch each).
    foreign: `experts` may hold E, a pair whose expert another rank holds."""
    t, hidden = x.shape
    num_experts, two_i = w13.data.shape[:2]
    inter = two_i // 2
    top_k = experts.shape[1]
    if t == 0 or top_k == 0:
        return torch.zeros_like(x)
    num_pairs = t * top_k
    sorted_pairs: torch.Tensor | None
    if t <= UNSORTED_MAX_TOKENS:
        sorted_pairs, block_experts = None, experts.reshape(-1).to(torch.int32)
        config = {**config, "BLOCK_M": 16}
    else:
        # The foreign pairs sort into one run more (id E), whose blocks the GEMM skips.
        sorted_pairs, block_experts = align_by_expert(
            experts, num_experts + foreign, config["BLOCK_M"]
        )
    a, a_scale = quantize_fp8_groups(x, act_group) if act_group else (x, None)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gemm(a, w13, h, None, sorted_pairs, block_experts, top_k, True, config, 0, a_scale)
    a, a_scale = quantize_fp8_groups(h, act_group) if act_group else (h, None)
    # A skipped pair's row is never written: zeros, so that the top-k sum adds nothing for it.
    y = (torch.zeros if foreign else torch.empty)(num_pairs, hidden, dtype=x.dtype, device=x.device)
    # y comes out [k, T, H]: summing k contiguous slabs is a vectorized add, where the sum over
    # the middle dim of [T, k, H] took 5.5 of Moonlight's 180 ms of an 8 x 2048 prefill.
    w = weights.reshape(-1)
    _gemm(a, w2, y, w, sorted_pairs, block_experts, 1, False, config, top_k, a_scale)
    return sum_slabs(y.view(top_k, t, hidden))


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    config: dict[str, int] | None = None,
    foreign: bool = False,
) -> torch.Tensor:
    """sum_j weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]) with e = experts[t, j].

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; weights [T, k] (any float
    dtype, applied in x's dtype's precision); experts [T, k] ints in [0, E), or [0, E] with
    `foreign` (the module's docstring). Returns [T, H].
    """
    t, hidden = x.shape
    num_experts, two_i, w13_hidden = w13.shape
    inter = two_i // 2
    if w13_hidden != hidden or two_i % 2 or w2.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
            "do not fit [T, H], [E, 2I, H], [E, H, I]"
        )
    _check_routing("fused_moe", x, weights, experts)
    config = config or tile_config(t * experts.shape[1], num_experts)
    return _moe(x, _ExpertWeights(w13), _ExpertWeights(w2), weights, experts, config, 0, foreign)


def _int_weights(
    name: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    shape: tuple[int, int, int],
    bits: int,
    group_size: int,
) -> _ExpertWeights:
    """One packed INT projection of logical `shape` (E, N, K), its shapes checked. A group of
    K or more (or <= 0) is one scale a row: what a channel-wise layer passes as its group is
    its first projection's K, past the second's."""
    e, n, k = shape
    group = min(group_size, k) if group_size > 0 else k
    want = (e, n, triton.cdiv(k, per_word(bits)))
    if packed.dtype != torch.int32 or tuple(packed.shape) != want:
        raise ValueError(
            f"{name}_packed must be int32 {want}, got {packed.dtype} {tuple(packed.shape)}"
        )
    groups = (e, n, k // group)
    if tuple(scale.shape) != groups:
        raise ValueError(f"{name}_scale must be {groups}, got {tuple(scale.shape)}")
    if zero is not None and tuple(zero.shape) != groups:
        raise ValueError(f"{name}_zero must be {groups} like the scales, got {tuple(zero.shape)}")
    return _ExpertWeights(packed, PACKED_INT, scale, zero, bits, group)


def fused_moe_int(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_zero: torch.Tensor | None,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_zero: torch.Tensor | None,
    weights: torch.Tensor,
    experts: torch.Tensor,
    bits: int,
    group_size: int,
    config: dict[str, Any] | None = None,
    foreign: bool = False,
) -> torch.Tensor:
    """fused_moe over packed INT experts (compressed-tensors pack-quantized, ember/kernels/
    quant_ref.py), W4A16 / W8A16: each weight tile dequantized in registers to x's dtype, as
    quant_ref.dequantize_int rounds it, and multiplied on the tensor cores. Up to
    UNSORTED_MAX_TOKENS tokens, a GEMV a (token, expert) pair on the CUDA cores instead
    (ember/kernels/fused_moe_decode.py, tiles fused_moe_decode.decode_config_int's), which
    rounds no weight; a config with BLOCK_M keeps those tokens on the tensor cores.

    x [T, H]; w13_packed int32 [E, 2I, H * bits / 32] (gate rows then up rows), w13_scale
    [E, 2I, H / g], w13_zero int8 [E, 2I, H / g] or None (symmetric); w2_packed int32
    [E, H, I * bits / 32], w2_scale [E, H, I / g], w2_zero or None; bits 4 or 8; group_size g a
    power of two (32, 64, 128) dividing H and I; <= 0, or not less than a projection's K, is
    channel-wise for it (scales [E, N, 1]). weights, experts [T, k] and `foreign` as fused_moe.
    Returns [T, H] in x's dtype.
    """
    pack = per_word(bits)  # refuses bits other than 4 and 8
    t, hidden = x.shape
    num_experts, two_i = w13_packed.shape[:2]
    inter = two_i // 2
    if two_i % 2 or w2_packed.shape[:2] != (num_experts, hidden):
        raise ValueError(
            f"fused_moe_int: x {tuple(x.shape)}, w13_packed {tuple(w13_packed.shape)}, "
            f"w2_packed {tuple(w2_packed.shape)} do not fit [T, H], [E, 2I, .], [E, H, .]"
        )
    for dim, size in (("H", hidden), ("I", inter)):
        if 0 < group_size < size:  # groups along this projection's K, not one a row
            if group_size & (group_size - 1) or group_size < pack:
                raise ValueError(
                    f"fused_moe_int: group_size {group_size} must be a power of two of at least "
                    f"{pack} (or <= 0 for channel-wise scales)"
                )
            if size % group_size:
                raise ValueError(
                    f"fused_moe_int: {dim} = {size} is not a multiple of the group ({group_size})"
                )
    w13 = _int_weights(
        "w13", w13_packed, w13_scale, w13_zero, (num_experts, two_i, hidden), bits, group_size
    )
    w2 = _int_weights(
        "w2", w2_packed, w2_scale, w2_zero, (num_experts, hidden, inter), bits, group_size
    )
    _check_routing("fused_moe_int", x, weights, experts)
    if t <= UNSORTED_MAX_TOKENS and (config is None or "BLOCK_M" not in config):
        # One live row a tile left the tensor cores bound by dequantizing: INT4 experts took
        # longer than bf16 ones at batch 1.
        return moe_int_decode(x, w13, w2, weights, experts, config, foreign)
    pairs = int4_pairs(w13, x.dtype) and int4_pairs(w2, x.dtype)
    config = config or tile_config_int(t * experts.shape[1], num_experts, bits, pairs)
    block_k = config["BLOCK_K"]
    if block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"fused_moe_int: BLOCK_K {block_k} must be a power of two >= 16")
    return _moe(x, w13, w2, weights, experts, config, 0, foreign)


def fused_moe_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    block: tuple[int, int],
    config: dict[str, int] | None = None,
    foreign: bool = False,
) -> torch.Tensor:
    """fused_moe over FP8 experts with one scale per `block` (rows, cols), W8A8 (DeepSeek-V3 /
    Kimi K2: 128 x 128): each GEMM's input (x for gate/up, h for down) quantized to e4m3 per
    token group of the block's cols, bit for bit as quant_ref.quantize_fp8_groups; fp8 tl.dot a
    K tile (BLOCK_K == the group), both scales applied to the fp32 accumulator. Up to
    UNSORTED_MAX_TOKENS tokens the same W8A8 products run a pair a program on the CUDA cores
    (fused_moe_decode.moe_fp8_decode, tiles decode_config_fp8's); a config with BLOCK_M keeps
    those tokens on the tensor cores.

    Where: config["QUANT_A"] 0 (the default) quantizes x and h in a launch of their own before
    each GEMM (fp8_gemm.quantize_fp8_groups), 1 in the K loop (each tile's rows are whole
    groups). In the loop saves two launches and a write and read of the activations, but every
    column tile repeats it: at Kimi K2's expert dims on an H200 (benchmarks/probes/
    moe_fp8_batches.py) 16-row tiles took 6.86 ms for 64 tokens quantizing in the loop and
    3.02 ms reading them quantized.

    x [T, H]; w13 float8_e4m3fn [E, 2I, H], w13_scale float32 [E, ceil(2I / bn), ceil(H / bk)];
    w2 [E, H, I], w2_scale [E, ceil(H / bn), ceil(I / bk)]; I a multiple of bn (a block holds
    gate or up rows, not both), or else w13_scale [E, 2I, ceil(H / bk)] (each row its block's); bk a power of two >= 32 (an fp8 tl.dot's least K on NVIDIA
    GPUs). weights, experts [T, k] and `foreign` as fused_moe. Returns [T, H] in x's dtype.
    """
    block_n, block_k = block
    t, hidden = x.shape
    num_experts, two_i, w13_hidden = w13.shape
    inter = two_i // 2
    if w13_hidden != hidden or two_i % 2 or w2.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"fused_moe_fp8: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
            "do not fit [T, H], [E, 2I, H], [E, H, I]"
        )
    if not supports_fp8(x):
        raise ValueError(
            f"fused_moe_fp8: fp8 tensor cores need compute capability 8.9+ ({x.device})"
        )
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"fused_moe_fp8: w13 and w2 must be float8_e4m3fn, got {w13.dtype}, {w2.dtype}"
        )
    if block_n < 1 or block_k < 32 or block_k & (block_k - 1):
        raise ValueError(
            f"fused_moe_fp8: block {tuple(block)} must be (rows >= 1, cols a power of two >= 32)"
        )
    cdiv = triton.cdiv
    # w13's scales may also come one a row (each row its block's): how a layer stacks gate and
    # up when I is not a multiple of the block rows.
    rows13 = 1 if w13_scale.dim() == 3 and w13_scale.shape[1] == two_i else block_n
    if inter % rows13:
        raise ValueError(
            f"fused_moe_fp8: I = {inter} is not a multiple of the block rows ({block_n}), so a "
            "scale block would hold both gate and up rows (give w13's scales one a row)"
        )
    for name, scale, (n, k), bn in (
        ("w13_scale", w13_scale, (two_i, hidden), rows13),
        ("w2_scale", w2_scale, (hidden, inter), block_n),
    ):
        want = (num_experts, cdiv(n, bn), cdiv(k, block_k))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"fused_moe_fp8: {name} must be {want} for block {tuple(block)}, "
                f"got {tuple(scale.shape)}"
            )
    _check_routing("fused_moe_fp8", x, weights, experts)
    b13 = _ExpertWeights(w13, FP8_BLOCK, w13_scale, None, 8, block_k, rows13)
    b2 = _ExpertWeights(w2, FP8_BLOCK, w2_scale, None, 8, block_k, block_n)
    if t <= UNSORTED_MAX_TOKENS and (config is None or "BLOCK_M" not in config):
        # A 16-row tensor-core tile for one live row redid the row's quantization around
        # every dot: Kimi K2's FP8 layer ran at 0.27 of its bytes at batch 1.
        return moe_fp8_decode(x, b13, b2, weights, experts, config, foreign)
    config = dict(config or tile_config_fp8(t * experts.shape[1], num_experts, block))
    quant_in_loop = config.pop("QUANT_A", 0)
    if config["BLOCK_K"] != block_k:
        raise ValueError(
            f"fused_moe_fp8: BLOCK_K {config['BLOCK_K']} must be the block's cols ({block_k}): "
            "a K tile is one activation group"
        )
    return _moe(x, b13, b2, weights, experts, config, 0 if quant_in_loop else block_k, foreign)
