"""The Triton RMSNorm against `RMSNorm` on fresh random inputs (interpreter on CPU, GPU when there)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from ember.kernels.rmsnorm import rms_norm
from ember.models.layers.norm import RMSNorm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Fresh inputs every run (fixed under CI, as the hypothesis profile is); failures print the seed.
BASE_SEED = 0 if os.environ.get("CI") else random.randrange(2**31)


@pytest.fixture(autouse=True)
def reference_in_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers dispatch to these kernels on CUDA; the references must stay plain PyTorch."""
    monkeypatch.setenv("EMBER_DISABLE_TRITON", "1")


EPS = 1e-6


def make_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int
) -> tuple[RMSNorm, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    norm = RMSNorm(hidden, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=g))
    norm = norm.to(device=device, dtype=dtype)
    # Rows at different scales, so a wrong per-row statistic cannot hide.
    scale = torch.rand(shape[:-1] + (1,), generator=g) * 4 + 0.1
    x = (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)
    residual = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return norm, x, residual


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-6, "atol": 1e-6}
    # A couple of units in the last place; values this close to zero are subnormal.
    finfo = torch.finfo(dtype)
    return {"rtol": 2 * finfo.eps, "atol": finfo.smallest_normal}


def check(out: torch.Tensor, ref: torch.Tensor, seed: int, min_equal: float = 0.0) -> None:
    assert not out.isnan().any(), f"seed {seed}: {int(out.isnan().sum())} elements unwritten"
    torch.testing.assert_close(out, ref, **tolerances(ref.dtype), msg=lambda m: f"seed {seed}: {m}")
    equal = (out == ref).float().mean().item()
    assert equal >= min_equal, f"seed {seed}: only {equal:.4f} of elements bit-equal"


def run_case(
    shape: tuple[int, ...], dtype: torch.dtype, mode: str, device: str, seed: int, min_equal: float
) -> None:
    norm, x, residual = make_inputs(shape, dtype, device, seed)
    w = norm.weight.detach()
    out = torch.full_like(x, float("nan"))
    with torch.no_grad():
        if mode == "plain":
            got = rms_norm(x, w, EPS, out=out)
            assert got is out
            check(out, norm(x), seed, min_equal)
            return
        ref_out, ref_sum = norm(x, residual)
        res = residual.clone()
        got_out, got_sum = rms_norm(x, w, EPS, res, out=out, inplace=mode == "inplace")
    assert got_out is out
    if mode == "inplace":
        assert got_sum is res
    else:
        assert torch.equal(res, residual), "residual changed without inplace=True"
    # The sum is a single rounding of x + residual in both: it must match exactly.
    assert torch.equal(got_sum, ref_sum), f"seed {seed}: x + residual differs"
    check(got_out, ref_out, seed, min_equal)


@pytest.mark.parametrize("case", range(2))
@pytest.mark.parametrize("mode", ["plain", "residual", "inplace"])
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 4096 + 64), (4, 6, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(
    dtype: torch.dtype, shape: tuple[int, ...], mode: str, case: int, device: str
) -> None:
    # fp16 rounds correctly in the interpreter too, so the rounding points are checked on CPU.
    run_case(
        shape, dtype, mode, device, BASE_SEED + case, min_equal=0.99 if dtype.itemsize == 2 else 0
    )


def test_head_norm_in_place_on_strided_view(device: str) -> None:
    """Qwen3's q-norm: q is a [T, Hq, D] view into the fused qkv output, normalized in place."""
    seed = BASE_SEED
    g = torch.Generator().manual_seed(seed)
    t, hq, hkv, d = 5, 4, 2, 96
    qkv = torch.randn(t, (hq + 2 * hkv) * d + 8, generator=g).to(device)
    qkv[:, hq * d :] = float("nan")  # k, v and padding: must stay untouched
    q = qkv[:, : hq * d].view(t, hq, d)
    norm = RMSNorm(d, EPS).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
        ref = norm(q.clone())
        got = rms_norm(q, norm.weight, EPS, out=q)
    assert got is q
    check(q, ref, seed)
    assert qkv[:, hq * d :].isnan().all(), "wrote outside q"


def test_out_aliases_x_and_residual_in_place(device: str) -> None:
    """The fused-add pattern that saves both allocations: norm into x, x + residual into residual."""
    seed = BASE_SEED + 1
    norm, x, residual = make_inputs((6, 200), torch.float32, device, seed)
    with torch.no_grad():
        ref_out, ref_sum = norm(x, residual)
        got_out, got_sum = rms_norm(x, norm.weight, EPS, residual, out=x, inplace=True)
    assert got_out is x and got_sum is residual
    assert torch.equal(residual, ref_sum)
    check(x, ref_out, seed)


def test_output_dtype_promotes_like_reference(device: str) -> None:
    """fp32 weight on fp16 activations: the reference rounds to fp16, then returns fp32."""
    seed = BASE_SEED + 2
    norm, x, _ = make_inputs((3, 64), torch.float32, device, seed)
    x = x.half()
    with torch.no_grad():
        ref = norm(x)
        got = rms_norm(x, norm.weight, EPS)
    assert ref.dtype == got.dtype == torch.float32
    check(got, ref, seed)


def test_empty_batch(device: str) -> None:
    x = torch.empty(0, 64, device=device)
    w = torch.ones(64, device=device)
    out, s = rms_norm(x, w, EPS, torch.empty(0, 64, device=device))
    assert out.shape == (0, 64) and s.shape == (0, 64)


def test_bad_input_raises(device: str) -> None:
    x = torch.randn(4, 64, device=device)
    w = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=device), EPS)
    with pytest.raises(ValueError, match="inplace"):
        rms_norm(x, w, EPS, inplace=True)
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(x, w, EPS, torch.randn(4, 32, device=device))
    with pytest.raises(ValueError, match="out has dtype"):
        rms_norm(x, w, EPS, out=torch.empty(4, 64, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        rms_norm(torch.randn(64, device=device), w, EPS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("mode", ["plain", "residual", "inplace"])
@pytest.mark.parametrize(
    "shape", [(1, 4096), (33, 4096 + 64), (17, 5120), (9, 14336), (257, 8, 128), (5, 896)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision(
    dtype: torch.dtype, shape: tuple[int, ...], mode: str, case: int
) -> None:
    run_case(shape, dtype, mode, "cuda", BASE_SEED + case, min_equal=0.99)
