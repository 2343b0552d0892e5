"""The one-row GEMV against F.linear on fresh random inputs, and when the Linear layer takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.kernels import gemv
from ember.models.layers.linear import Linear, StackedLinear

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("n", "k"),
    [(40, 256), (37, 1024), (8, 2048 + 96), (300, 576)],
    ids=["small", "odd-n", "k-tail", "smollm2-k"],
)
def test_gemv_matches_linear(seed: int, n: int, k: int, device: str) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(device)
    x = torch.randn(1, k, generator=g).to(device)
    torch.testing.assert_close(gemv.gemv(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_gemv_takes_a_row_of_a_bigger_buffer_and_any_leading_shape(device: str) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 128, generator=g).to(device)
    buf = torch.randn(4, 128, generator=g).to(device)
    row = buf[2:3]  # a graph's static input: one row at an offset into a larger tensor
    torch.testing.assert_close(gemv.gemv(row, w), F.linear(row, w), rtol=1e-4, atol=1e-4)
    x3 = buf[1].view(1, 1, 128)
    assert gemv.gemv(x3, w).shape == (1, 1, 24)
    torch.testing.assert_close(gemv.gemv(x3, w), F.linear(x3, w), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(buf[:2], w)


def test_linear_takes_the_gemv_for_one_row_only(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    if device == "cpu":  # the Triton path on the CPU: the interpreter (tests/conftest.py)
        monkeypatch.setenv("EMBER_TRITON_ON_CPU", "1")
    small = Linear(64, 16, bias=False).to(device)
    assert not gemv.usable(torch.randn(1, 64, device=device), small.weight, None)  # cuBLAS's
    monkeypatch.setattr(gemv, "MIN_WEIGHT_ELEMENTS", 0)
    calls: list[tuple[int, ...]] = []
    real = gemv.gemv

    def counting(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, w)

    monkeypatch.setattr(gemv, "gemv", counting)
    lin = Linear(64, 16, bias=False).to(device)
    one, two = torch.randn(1, 64, device=device), torch.randn(2, 64, device=device)
    with torch.no_grad():
        torch.testing.assert_close(lin(one), F.linear(one, lin.weight), rtol=1e-4, atol=1e-4)
        lin(two)  # two rows: cuBLAS (F.linear)
        Linear(64, 16, bias=True).to(device)(one)  # a bias: F.linear
        stacked = StackedLinear(64, {"a": 8, "b": 8}).to(device)
        stacked(one)
        lin(torch.randn(1, 128, device=device)[:, ::2])  # a row with a stride: F.linear
    assert calls == [(1, 64), (1, 64)]
    monkeypatch.setenv("EMBER_DISABLE_TRITON", "1")
    with torch.no_grad():
        lin(one)
    assert len(calls) == 2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 14336), (49152, 576), (1000, 4096 + 512)]
)
def test_gemv_llama3_8b_shapes(dtype: torch.dtype, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, generator=g, device="cuda", dtype=dtype) * 0.02
    x = torch.randn(1, k, generator=g, device="cuda", dtype=dtype)
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(gemv.gemv(x, w).float(), want, rtol=2e-2, atol=2e-2)
