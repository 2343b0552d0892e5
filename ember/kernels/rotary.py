"""Rotary position embedding (NeoX rotate-half) for q and k in one Triton launch.

Reference: `ember.models.layers.rotary.RotaryEmbedding.forward`. One program per token rotates
every head of its q and k row, so the token's cos/sin row is read once for all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    x_sh,
    x_sd,
    o_sh,
    o_sd,
    cos1,
    sin1,
    cos2,
    sin2,
    d,
    d_mask,
    N_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    c_ptr,
    c_sh,
    c_ok,
    WRITE_C: tl.constexpr,
):
    for h0 in range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < N_HEADS)[:, None] & d_mask[None, :]
        o1_ptrs = o_ptr + h[:, None] * o_sh + d[None, :] * o_sd
        if INTERLEAVED:  # pairs (x_i, y_i) side by side in; halves out, as deinterleave() makes
            x1_ptrs = x_ptr + h[:, None] * x_sh + (2 * d)[None, :] * x_sd
            x2_ptrs = x1_ptrs + x_sd
        else:
            x1_ptrs = x_ptr + h[:, None] * x_sh + d[None, :] * x_sd
            x2_ptrs = x1_ptrs + HALF * x_sd
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x2_ptrs, mask=mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1). Each output pair is
        # computed from its own input pair, loaded in full first, so in-place writes are safe.
        o1 = x1 * cos1[None, :] - x2 * sin1[None, :]
        o2 = x2 * cos2[None, :] + x1 * sin2[None, :]
        tl.store(o1_ptrs, o1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o1_ptrs + HALF * o_sd, o2.to(o_ptr.dtype.element_ty), mask=mask)
        if WRITE_C:  # the rotated rows straight into their KV-cache slot too
            c1_ptrs = c_ptr + h[:, None] * c_sh + d[None, :]
            tl.store(c1_ptrs, o1.to(c_ptr.dtype.element_ty), mask=mask & c_ok)
            tl.store(c1_ptrs + HALF, o2.to(c_ptr.dtype.element_ty), mask=mask & c_ok)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_st,
    q_sh,
    q_sd,
    k_st,
    k_sh,
    k_sd,
    qo_st,
    qo_sh,
    qo_sd,
    ko_st,
    ko_sh,
    ko_sd,
    cos_sp,
    cos_sd,
    sin_sp,
    sin_sd,
    cache_ptr,
    v_ptr,
    slot_ptr,
    v_st,
    v_sh,
    c_sb,
    c_skv,
    c_st,
    c_sh,
    N_Q_HEADS: tl.constexpr,
    N_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PAGE: tl.constexpr,
    WRITE_KV: tl.constexpr,
):
    # Head counts and head_dim are model constants (one compile per model); as constexprs they fold
    # the loop bounds and masks. int64 token index: T * token stride can pass 2**31.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    # Both halves of the cache row are read (not just the first, though the cache repeats it), so
    # any [P, D] table gives what the reference gives.
    cos_row = cos_ptr + pos * cos_sp
    sin_row = sin_ptr + pos * sin_sp
    cos1 = tl.load(cos_row + d * cos_sd, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + (d + HALF) * cos_sd, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + d * sin_sd, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + (d + HALF) * sin_sd, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + t * q_st,
        qo_ptr + t * qo_st,
        q_sh,
        q_sd,
        qo_sh,
        qo_sd,
        cos1,
        sin1,
        cos2,
        sin2,
        d,
        d_mask,
        N_Q_HEADS,
        HALF,
        BLOCK_HQ,
        INTERLEAVED,
        qo_ptr,
        0,
        False,
        False,
    )
    c_row = cache_ptr
    c_ok = False
    if WRITE_KV:
        # K and V into the token's paged slot ([blocks, 2, page, heads, D] with any strides);
        # slot -1 marks a padding row (CUDA-graph batches), written nowhere.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        c_ok = slot >= 0
        c_row = cache_ptr + (slot // PAGE) * c_sb + (slot % PAGE) * c_st
    _rotate_heads(
        k_ptr + t * k_st,
        ko_ptr + t * ko_st,
        k_sh,
        k_sd,
        ko_sh,
        ko_sd,
        cos1,
        sin1,
        cos2,
        sin2,
        d,
        d_mask,
        N_K_HEADS,
        HALF,
        BLOCK_HK,
        INTERLEAVED,
        c_row,
        c_sh,
        c_ok,
        WRITE_KV,
    )
    if WRITE_KV:
        for h0 in range(0, N_K_HEADS, BLOCK_HK):
            h = h0 + tl.arange(0, BLOCK_HK)
            mask = (h < N_K_HEADS)[:, None] & d_mask[None, :]
            src = v_ptr + t * v_st + h[:, None] * v_sh + d[None, :]
            dst = c_row + c_skv + h[:, None] * c_sh + d[None, :]
            v1 = tl.load(src, mask=mask, other=0.0)
            v2 = tl.load(src + HALF, mask=mask, other=0.0)
            tl.store(dst, v1.to(cache_ptr.dtype.element_ty), mask=mask & c_ok)
            tl.store(dst + HALF, v2.to(cache_ptr.dtype.element_ty), mask=mask & c_ok)


# Elements per half-head tile of one loop step: 2048 -> 32 heads of head_dim 128, 16 fp32 values
# per thread per half at 4 warps, so a Llama-8B token (32 q heads, 8 kv heads) is one step each.
_TILE = 2048
NUM_WARPS = 4


def launch_config(n_q_heads: int, n_k_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, BLOCK_D) for one token's q and k rows."""
    block_d = triton.next_power_of_2(head_dim // 2)
    cap = max(1, _TILE // block_d)
    block_hq = min(triton.next_power_of_2(max(n_q_heads, 1)), cap)
    block_hk = min(triton.next_power_of_2(max(n_k_heads, 1)), cap)
    return block_hq, block_hk, block_d


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    inplace: bool = False,
    interleaved: bool = False,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their token's position; fp32 math.

    positions: [T] integer indices into cos_cache / sin_cache [P, D] (not bounds-checked on the
    device: an index past P reads out of bounds). Returns (q_out, k_out) in q's and k's dtypes;
    `inplace=True` writes them into q and k and returns those; `q_out`/`k_out` (any strides) may
    be given. `interleaved`: the inputs hold their rotation pairs side by side (DeepSeek's
    `rope_interleave`) and the outputs come in halves, deinterleaved; never in place.
    With `kv_cache` (one layer's [blocks, 2, page, Hkv, D], any strides), `v` [T, Hkv, D] and
    `slot_mapping` [T] (slot -1: skipped), the same launch also writes the rotated k and v into
    their cache slots, as write_kv would after it: one launch a layer fewer.
    """
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be [T, heads, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    n_tokens, n_q_heads, head_dim = q.shape
    if k.shape[0] != n_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in T or D")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half, got {head_dim}")
    if positions.shape != (n_tokens,) or positions.is_floating_point():
        raise ValueError(
            f"positions must be integer [{n_tokens}], got {positions.dtype} {tuple(positions.shape)}"
        )
    for name, cache in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if cache.dim() != 2 or cache.shape[1] != head_dim:
            raise ValueError(f"{name} must be [P, {head_dim}], got {tuple(cache.shape)}")
    others = {"k": k, "positions": positions, "cos_cache": cos_cache, "sin_cache": sin_cache}
    for name, t in others.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q is on {q.device}")

    if inplace and interleaved:
        raise ValueError("an interleaved rotation cannot be done in place")
    if inplace:
        q_out, k_out = q, k
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q_out.shape != q.shape or k_out.shape != k.shape:
        raise ValueError(
            f"q_out {tuple(q_out.shape)} and k_out {tuple(k_out.shape)} must match q and k"
        )
    if n_tokens == 0 or head_dim == 0:
        return q_out, k_out
    write_kv = kv_cache is not None
    if write_kv:
        if v is None or slot_mapping is None or interleaved:
            raise ValueError("writing the KV cache needs v and slot_mapping, and no interleave")
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[3:] != k.shape[1:]:
            raise ValueError(
                f"kv_cache {tuple(kv_cache.shape)} must be [blocks, 2, page, {k.shape[1]}, "
                f"{head_dim}]"
            )
        if v.shape != k.shape or slot_mapping.shape != (n_tokens,):
            raise ValueError(f"v {tuple(v.shape)} and slot_mapping must match k and T")
        if kv_cache.stride(4) != 1 or v.stride(2) != 1:
            raise ValueError("kv_cache and v must be contiguous in head_dim")
        cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2))
        cache_strides += (kv_cache.stride(3),)
        v_strides = (v.stride(0), v.stride(1))
        page = kv_cache.shape[2]
    else:
        kv_cache, v, slot_mapping = q_out, q, positions  # unused: WRITE_KV is off
        cache_strides, v_strides, page = (0, 0, 0, 0), (0, 0), 1
    block_hq, block_hk, block_d = launch_config(n_q_heads, k.shape[1], head_dim)
    _rotary_kernel[(n_tokens,)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_cache,
        sin_cache,
        *q.stride(),
        *k.stride(),
        *q_out.stride(),
        *k_out.stride(),
        *cos_cache.stride(),
        *sin_cache.stride(),
        kv_cache,
        v,
        slot_mapping,
        *v_strides,
        *cache_strides,
        N_Q_HEADS=n_q_heads,
        N_K_HEADS=k.shape[1],
        HALF=head_dim // 2,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_D=block_d,
        INTERLEAVED=interleaved,
        PAGE=page,
        WRITE_KV=write_kv,
        num_warps=NUM_WARPS,
    )
    return q_out, k_out
