"""The Triton KV-cache scatter against its plain-PyTorch reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.kv_dtype import FP8_MAX, to_cache
from ember.kernels.kv_write import write_kv, write_kv_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    src_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: str,
    seed: int,
    spread: float = 1.0,
) -> None:
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 3
    # Distinct random slots anywhere in the cache; about a fifth are -1 (padding rows).
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.2] = -1
    # k and v as the model makes them: strided views into one fused qkv projection.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g) * spread
    qkv = qkv.to(src_dtype)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    # NaN everywhere: a slot the kernel should not touch stays NaN, one it should is overwritten.
    full = torch.full((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), float("nan"))
    full = full.to(cache_dtype)
    want = full.clone()
    write_kv_ref(want[:, 0], k, v, slots)

    full = full.to(device)
    write_kv(full[:, 0], k.to(device), v.to(device), slots.to(device))
    # (compared as float32: assert_close does not compare FP8 tensors)
    torch.testing.assert_close(full.cpu().float(), want.float(), rtol=0, atol=0, equal_nan=True)
    # The reference itself wrote every kept row and nothing else.
    written = (~want[:, 0].isnan()).any(-1).any(-1).sum().item()
    assert written == 2 * int((slots >= 0).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size",
    [(1, 1, 16, 16), (37, 2, 64, 16), (20, 8, 128, 16), (50, 3, 32, 8)],
)
def test_write_kv_fp32(
    seed: int, num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, device: str
) -> None:
    _run(num_tokens, num_kv_heads, head_dim, block_size, torch.float32, torch.float32, device, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_write_kv_casts_to_cache_dtype(seed: int, device: str) -> None:
    _run(29, 2, 64, 16, torch.float32, torch.float16, device, seed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_write_kv_gpu(seed: int, dtype: torch.dtype, block_size: int) -> None:
    _run(4096, 8, 128, block_size, dtype, dtype, "cuda", seed)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fp8(seed: int, src_dtype: torch.dtype, device: str) -> None:
    """An FP8 cache: the kernel rounds as torch does and saturates at +-448 (values up to about
    1,500 here) rather than storing NaN."""
    _run(41, 2, 64, 16, src_dtype, torch.float8_e4m3fn, device, seed, spread=400.0)


def test_fp8_round_trip() -> None:
    """What an FP8 cache gives back: within FP8 E4M3's rounding (3 mantissa bits: half an ulp is
    1/16 of the value) of what was written, exactly torch's rounding, saturated past 448."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-2, 3, 4096)
    back = to_cache(x, torch.float8_e4m3fn).float()
    inside = x.abs() <= FP8_MAX
    assert torch.equal(back[inside], x[inside].to(torch.float8_e4m3fn).float())
    normal = inside & (x.abs() >= 2**-6)  # E4M3's smallest normal number
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 1 / 16 + 1e-6
    assert torch.equal(back[~inside], FP8_MAX * x[~inside].sign())
    assert not back.isnan().any()


def test_write_kv_all_padding(device: str) -> None:
    cache = torch.full((2, 2, 16, 1, 16), float("nan"), device=device)
    k = torch.randn(3, 1, 16, device=device)
    write_kv(cache, k, k, torch.full((3,), -1, device=device))
    assert cache.isnan().all()


def test_write_kv_rejects_bad_shapes(device: str) -> None:
    cache = torch.zeros(4, 2, 16, 2, 16, device=device)
    k = torch.zeros(3, 2, 16, device=device)
    with pytest.raises(ValueError, match="must both be"):
        write_kv(cache, k, torch.zeros(3, 1, 16, device=device), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(cache, k, k, torch.zeros(2, dtype=torch.long, device=device))


@pytest.mark.parametrize("seed", [0, 1])
def test_one_plane_latents_are_written_and_padding_skipped(seed: int) -> None:
    """MLA's one-plane cache (v None): each kept row's latent lands in its slot of a strided
    layer view, a -1 slot (a CUDA-graph padding row) writes nothing, nothing else changes."""
    from ember.attention.mla import write_latent

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    blocks, page, dim, t = 6, 4, 40, 13
    slots = torch.randperm(blocks * page, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.3] = -1
    latent = torch.randn(t, dim, generator=g)
    full = torch.full((blocks, 3, 1, page, 1, dim), float("nan"))  # 3 layers
    want = full.clone()
    keep = slots >= 0
    write_latent(want[:, 1], latent[keep], slots[keep])
    full = full.to(device)
    write_kv(full[:, 1], latent.unsqueeze(1).to(device), None, slots.to(device))
    torch.testing.assert_close(full.cpu(), want, rtol=0, atol=0, equal_nan=True)
    assert not torch.isnan(want[:, 1]).all()  # some rows were written
    with pytest.raises(ValueError, match="kv_cache must be"):
        write_kv(full[:, 1], latent.unsqueeze(1).to(device), latent.unsqueeze(1).to(device), slots)
