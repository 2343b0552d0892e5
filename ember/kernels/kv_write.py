"""Scatter this step's K and V rows into their paged KV-cache slots (Triton).

Bytes: each kept row reads num_kv_heads * head_dim K and V elements once and writes them once, so
a step of T tokens moves 4 * T * num_kv_heads * head_dim * itemsize bytes; nothing is computed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.kv_dtype import to_cache


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kv_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_tok,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_V: tl.constexpr,
):
    # One program per token row: all its heads at once, so each store is a run of whole rows.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # Slot -1 marks a padding row (CUDA-graph batches): masked off rather than branched on.
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :] & (slot >= 0)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    dst = (
        kv_ptr
        + block * stride_cache_block
        + offset * stride_cache_tok
        + h[:, None] * stride_cache_head
        + d[None, :]
    )
    tl.store(dst, _to_cache(k, kv_ptr.dtype.element_ty), mask=mask)
    if HAS_V:
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(dst + stride_cache_kv, _to_cache(v, kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _to_cache(x, dtype: tl.constexpr):
    """x as a cache of `dtype` stores it: FP8 saturates at +-448 (kv_dtype.FP8_MAX)."""
    if dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(dtype)


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor
) -> None:
    """Write k[t], v[t] ([T, num_kv_heads, head_dim]) into slot slot_mapping[t]; -1 skips row t.

    kv_cache is one layer's view [num_blocks, 2, block_size, num_kv_heads, head_dim]; it may be
    strided across blocks (a slice of the all-layer cache) but its last dim must be contiguous.
    With v None the cache has one plane ([num_blocks, 1, ...], MLA's latents) and k fills it.
    """
    planes = 1 if v is None else 2
    if kv_cache.dim() != 5 or kv_cache.shape[1] != planes:
        raise ValueError(
            f"kv_cache must be [num_blocks, {planes}, block_size, H, D], got {kv_cache.shape}"
        )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if v is None:
        v = k
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{k.shape[0]}]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if kv_cache.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("kv_cache, k and v must be contiguous in head_dim")
    if k.shape[0] == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(k.shape[0],)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE_SIZE=block_size,
        HAS_V=planes == 2,
        # A row of 8 heads x 128 dims is 1024 elements: 4 warps give each thread 8 (16 bytes).
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def write_kv_ref(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-PyTorch reference: ember.attention.torch_backend.write_kv, with -1 slots skipped.

    Kept here rather than imported so that kernels/ does not reach up into attention/, which
    sits above it.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = to_cache(k[keep], kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = to_cache(v[keep], kv_cache.dtype)
