"""The q/k/v GEMV with the rotation and the KV write in its epilogue (`gemv.gemv_qkv_rope`): the
bits of the GEMV followed by `apply_rotary(..., kv_cache=...)`, on fresh random inputs (its greedy
decoding against the unfused path: tests/kernels/test_gemv.py)."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import gemv
from ember.kernels.rotary import apply_rotary
from ember.models.layers.rotary import RotaryEmbedding

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _check(
    hq: int, hkv: int, d: int, k: int, dtype: torch.dtype, device: str, slot: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device)
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    rope = RotaryEmbedding(d, 4096, 500000.0).to(device)
    pos = torch.tensor([1234 + seed], device=device)
    slots = torch.tensor([slot], device=device)
    page, blocks = 16, 8  # slots 0-127
    assert slot < page * blocks
    caches = [torch.randn(blocks, 2, page, hkv, d, generator=g).to(dtype).to(device)]
    caches.append(caches[0].clone())
    # Unfused: the GEMV, then the rotation writing k and v into the cache.
    y = gemv.gemv(x, w)
    q, kk, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
    q_want, k_want = apply_rotary(
        q.view(1, hq, d), kk.view(1, hkv, d), pos, rope.cos_cache, rope.sin_cache,
        kv_cache=caches[0], v=v.view(1, hkv, d), slot_mapping=slots,
    )  # fmt: skip
    got = gemv.gemv_qkv_rope(x, w, pos, rope.cos_cache, rope.sin_cache, caches[1], slots, hq, hkv)
    q_got, k_got, v_got = got.split([hq * d, hkv * d, hkv * d], dim=-1)
    assert torch.equal(q_got.view(1, hq, d), q_want)
    assert torch.equal(k_got.view(1, hkv, d), k_want)
    assert torch.equal(v_got, v)
    assert torch.equal(caches[1], caches[0])  # the slot's K and V, nothing else touched
    if slot >= 0:
        b, t = divmod(slot, page)
        assert torch.equal(caches[1][b, 1, t], v.view(hkv, d))


@pytest.mark.parametrize("slot", [19, -1], ids=["slot", "padding-row"])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "k"), [(4, 2, 16, 256), (6, 2, 32, 1024 + 64)], ids=["small", "k-tail"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rope_is_the_gemv_then_the_rotation_to_the_bit(
    hq: int, hkv: int, d: int, k: int, dtype: torch.dtype, slot: int, device: str
) -> None:
    _check(hq, hkv, d, k, dtype, device, slot, 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gemv_rope_llama3_8b_qkv(seed: int) -> None:
    _check(32, 8, 128, 4096, torch.bfloat16, "cuda", 101, seed)  # block 6 of 8, row 5


def test_rope_usable_wants_whole_heads_a_full_rotation_and_the_cache_in_x_dtype(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    if device == "cpu":  # the Triton path on the CPU: the interpreter (tests/conftest.py)
        monkeypatch.setenv("EMBER_TRITON_ON_CPU", "1")
    monkeypatch.setattr(gemv, "MIN_WEIGHT_ELEMENTS", 0)
    x = torch.randn(1, 64, device=device)
    w = torch.randn((4 + 2 * 2) * 16, 64, device=device)
    cos, sin = torch.randn(32, 16, device=device), torch.randn(32, 16, device=device)
    cache = torch.randn(4, 2, 16, 2, 16, device=device)

    def usable(**change: object) -> bool:
        args = dict(x=x, weight=w, bias=None, num_q_heads=4, num_kv_heads=2)
        args.update(cos_cache=cos, sin_cache=sin, kv_cache=cache)
        return gemv.rope_usable(**{**args, **change})

    assert usable()
    assert not usable(weight=w[:-16])  # not whole heads
    assert not usable(cos_cache=cos[:, :8], sin_cache=sin[:, :8])  # a partial rotation
    assert not usable(sin_cache=torch.randn(16, 32, device=device).t())  # sin not contiguous
    assert not usable(bias=torch.zeros(w.shape[0], device=device))  # a bias: cuBLAS
    assert not usable(kv_cache=cache.half())  # another cache dtype
    assert not usable(x=torch.randn(2, 64, device=device))  # two rows
    monkeypatch.setattr(gemv, "MIN_WEIGHT_ELEMENTS", w.numel())  # a tiny model's: cuBLAS
    assert not usable()
