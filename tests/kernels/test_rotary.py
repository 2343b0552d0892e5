"""The Triton rotary kernel against `RotaryEmbedding.forward` on fresh random inputs."""

from __future__ import annotations

import os
import random

import pytest
import torch

from ember.kernels.rotary import apply_rotary
from ember.models.layers.rotary import RotaryEmbedding

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Fresh inputs every run (fixed under CI, as the hypothesis profile is); failures print the seed.
BASE_SEED = 0 if os.environ.get("CI") else random.randrange(2**31)

MAX_POSITION = 4096
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@pytest.fixture(autouse=True)
def reference_in_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers dispatch to these kernels on CUDA; the references must stay plain PyTorch."""
    monkeypatch.setenv("EMBER_DISABLE_TRITON", "1")


def make_inputs(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, seed: int, scaled: bool
) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rope, qkv [T, (Hq + 2 Hkv) D + 8] with NaN v/padding, positions [T]) for (T, Hq, Hkv, D)."""
    t, hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(
        d, MAX_POSITION, 500000.0 if scaled else 10000.0, LLAMA3_SCALING if scaled else None
    ).to(device)
    # q and k as the model has them: views into the fused qkv projection, so strided.
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 8, generator=g)
    qkv[:, (hq + hkv) * d :] = float("nan")
    positions = torch.randint(0, MAX_POSITION, (t,), generator=g)
    return rope, qkv.to(device=device, dtype=dtype), positions.to(device)


def split(qkv: torch.Tensor, shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, hkv, d = shape
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    return q, k


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-6, "atol": 1e-6}
    # A couple of units in the last place. x*cos + rot(x)*sin can cancel to almost nothing, where
    # a fused multiply-add on the GPU and separate ones in PyTorch round differently (seen on an
    # H200: 7e-9 against 0 for inputs of order 1), so a tiny absolute slack as well.
    finfo = torch.finfo(dtype)
    return {"rtol": 2 * finfo.eps, "atol": 1e-6}


def check(out: torch.Tensor, ref: torch.Tensor, seed: int, min_equal: float = 0.0) -> None:
    assert not out.isnan().any(), f"seed {seed}: {int(out.isnan().sum())} elements unwritten"
    torch.testing.assert_close(out, ref, **tolerances(ref.dtype), msg=lambda m: f"seed {seed}: {m}")
    equal = (out == ref).float().mean().item()
    assert equal >= min_equal, f"seed {seed}: only {equal:.4f} of elements bit-equal"


def run_case(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    inplace: bool,
    scaled: bool,
    device: str,
    seed: int,
    min_equal: float,
) -> None:
    rope, qkv, positions = make_inputs(shape, dtype, device, seed, scaled)
    q, k = split(qkv, shape)
    ref_q, ref_k = rope(positions, q, k)
    before = qkv.clone()
    got_q, got_k = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache, inplace=inplace)
    if inplace:
        assert got_q is q and got_k is k
        tail = (shape[1] + shape[2]) * shape[3]
        assert qkv[:, tail:].isnan().all(), "wrote outside q and k"
    else:
        assert torch.equal(qkv.nan_to_num(), before.nan_to_num()), "input changed"
    check(got_q, ref_q, seed, min_equal)
    check(got_k, ref_k, seed, min_equal)


@pytest.mark.parametrize("case", range(2))
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    # (T, Hq, Hkv, D): MHA; GQA with head_dim 96 (half not a power of two); 40 q heads, more than
    # one loop step of 32; head_dim 256.
    "shape",
    [(1, 2, 2, 64), (5, 4, 2, 96), (3, 40, 8, 128), (2, 3, 1, 256)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(
    dtype: torch.dtype, shape: tuple[int, int, int, int], inplace: bool, case: int, device: str
) -> None:
    # fp16 rounds correctly in the interpreter too, so the output rounding is checked on CPU.
    min_equal = 0.99 if dtype.itemsize == 2 else 0.0
    run_case(shape, dtype, inplace, case == 1, device, BASE_SEED + case, min_equal)


def test_int32_positions_and_empty_batch(device: str) -> None:
    shape = (4, 2, 1, 64)
    rope, qkv, positions = make_inputs(shape, torch.float32, device, BASE_SEED, scaled=False)
    q, k = split(qkv, shape)
    ref_q, ref_k = rope(positions, q, k)
    got_q, got_k = apply_rotary(q, k, positions.int(), rope.cos_cache, rope.sin_cache)
    check(got_q, ref_q, BASE_SEED)
    check(got_k, ref_k, BASE_SEED)
    eq, ek = apply_rotary(q[:0], k[:0], positions[:0], rope.cos_cache, rope.sin_cache)
    assert eq.shape == (0, 2, 64) and ek.shape == (0, 1, 64)


def test_bad_input_raises(device: str) -> None:
    rope = RotaryEmbedding(64, 16, 10000.0).to(device)
    q = torch.randn(3, 4, 64, device=device)
    k = torch.randn(3, 2, 64, device=device)
    pos = torch.arange(3, device=device)
    cos, sin = rope.cos_cache, rope.sin_cache
    with pytest.raises(ValueError, match=r"\[T, heads, D\]"):
        apply_rotary(q[0], k, pos, cos, sin)
    with pytest.raises(ValueError, match="does not match"):
        apply_rotary(q, k[:2], pos, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(q, k, pos.float(), cos, sin)
    with pytest.raises(ValueError, match="cos_cache"):
        apply_rotary(q, k, pos, cos[:, :32], sin)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(q[..., :63], k[..., :63], pos, cos[:, :63], sin[:, :63])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    # Llama-3-8B prefill, a decode batch, Llama-70B (64 q heads), Qwen2-0.5B (14/2, D 64).
    "shape",
    [(257, 32, 8, 128), (7, 32, 8, 128), (33, 64, 8, 128), (65, 14, 2, 64)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision(
    dtype: torch.dtype, shape: tuple[int, int, int, int], inplace: bool, case: int
) -> None:
    run_case(shape, dtype, inplace, case == 1, "cuda", BASE_SEED + case, min_equal=0.99)


@pytest.mark.parametrize(
    "scaling",
    [
        # DeepSeek-V3's and Kimi K2's rope_scaling (Kimi: factor 32, the same mscales).
        {
            "type": "yarn",
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 4096,
        },
        {
            "rope_type": "yarn",
            "factor": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "attention_factor": 1.3,
            "beta_fast": 16,
            "original_max_position_embeddings": 1024,
            "truncate": False,
        },
    ],
)
def test_yarn_matches_transformers(scaling: dict) -> None:
    """YaRN's inverse frequencies and its cos/sin factor equal transformers' for DeepSeek's and
    Kimi's settings and the variants (no mscales, an explicit attention_factor, no truncation)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ember.models.layers.rotary import rope_attention_factor, rope_inv_freq

    cfg = DeepseekV3Config(
        qk_rope_head_dim=64,
        rope_theta=10000.0,
        rope_scaling=dict(scaling),
        max_position_embeddings=4096 * 40,
    )
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got = rope_inv_freq(64, 10000.0, scaling)
    torch.testing.assert_close(got, want_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-9)
    rope = RotaryEmbedding(64, 64, 10000.0, scaling)
    pos = torch.arange(64, dtype=torch.float32)
    emb = torch.outer(pos, want_freq)
    emb = torch.cat((emb, emb), dim=-1)
    torch.testing.assert_close(rope.cos_cache, emb.cos() * want_factor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [1, 4, 40])
def test_interleaved_into_given_outputs(heads: int, device: str) -> None:
    """DeepSeek's layout: q's rope part a strided slice of a wider row, k's a slice of the latent
    projection, pairs side by side; the results land deinterleaved in the outputs given (q in a
    buffer of its own, k in a strided slice of the latent row), equal to deinterleave + rotate."""
    from ember.models.layers.rotary import deinterleave

    g = torch.Generator().manual_seed(BASE_SEED + heads)
    t, nope, rope_dim, rank = 7, 16, 64, 32
    rope = RotaryEmbedding(rope_dim, MAX_POSITION, 10000.0).to(device)
    q = torch.randn(t, heads, nope + rope_dim, generator=g).to(device)
    kv = torch.randn(t, rank + rope_dim, generator=g).to(device)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=g).to(device)
    q_in, k_in = q[..., nope:], kv[:, rank:].unsqueeze(1)
    want_q, want_k = rope(positions, deinterleave(q_in), deinterleave(k_in))
    q_out = torch.full((t, heads, rope_dim), float("nan"), device=device)
    latent = torch.full((t, rank + rope_dim), float("nan"), device=device)
    k_out = latent[:, rank:].unsqueeze(1)
    got_q, got_k = apply_rotary(
        q_in,
        k_in,
        positions,
        rope.cos_cache,
        rope.sin_cache,
        interleaved=True,
        q_out=q_out,
        k_out=k_out,
    )
    assert got_q is q_out and got_k is k_out
    check(q_out, want_q, BASE_SEED)
    check(latent[:, rank:], want_k[:, 0], BASE_SEED)
    assert latent[:, :rank].isnan().all()  # nothing written outside the slice
    # The module's own path (the reference on the CPU) takes the same arguments.
    q_ref = torch.empty_like(q_out)
    rope(positions, q_in, k_in, interleaved=True, q_out=q_ref)
    check(q_ref, want_q, BASE_SEED)
    with pytest.raises(ValueError, match="in place"):
        apply_rotary(
            q_in, k_in, positions, rope.cos_cache, rope.sin_cache, inplace=True, interleaved=True
        )


@pytest.mark.parametrize(
    "heads,head_dim,page", [((4, 2), 16, 4), ((8, 1), 64, 16), ((3, 3), 32, 8)]
)
def test_rotation_writes_k_and_v_into_their_cache_slots(
    heads: tuple[int, int], head_dim: int, page: int, device: str
) -> None:
    """With a KV cache, the one launch leaves q and k as apply_rotary does and the cache as
    write_kv of the rotated k and of v would: one layer's strided view of a multi-layer cache,
    slots out of order, padding rows (slot -1) written nowhere."""
    from ember.kernels.kv_write import write_kv

    g = torch.Generator().manual_seed(head_dim + page)
    t, (hq, hkv) = 11, heads
    q = torch.randn(t, hq, head_dim, generator=g)
    k = torch.randn(t, hkv, head_dim, generator=g)
    v = torch.randn(t, hkv, head_dim, generator=g)
    rope = RotaryEmbedding(head_dim, 256, 10000.0)
    positions = torch.randint(0, 256, (t,), generator=g)
    slots = torch.randperm(6 * page, generator=g)[:t]
    slots[[2, 7]] = -1
    full = torch.randn(6, 3, 2, page, hkv, head_dim, generator=g)  # 3 layers, block-major
    want_cache = full.clone()
    args = [x.to(device) for x in (q, k, positions, rope.cos_cache, rope.sin_cache)]
    want_q, want_k = apply_rotary(*args)
    want_cache = want_cache.to(device)
    write_kv(want_cache[:, 1], want_k, v.to(device), slots.to(device))
    got_cache = full.to(device)
    got_q, got_k = apply_rotary(
        *args, kv_cache=got_cache[:, 1], v=v.to(device), slot_mapping=slots.to(device)
    )
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs v and slot_mapping"):
        apply_rotary(*args, kv_cache=got_cache[:, 1])
