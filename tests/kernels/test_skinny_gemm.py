"""The skinny GEMM (ember/kernels/skinny_gemm.py) against F.linear on fresh random inputs: one row
to sixteen, K and N no tile divides, a strided x; fp32 in the interpreter, bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.kernels.skinny_gemm import MAX_ROWS, skinny_linear

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(40, 24), (16, 600), (33, 70)])
def test_skinny_linear_matches_f_linear(m: int, n: int, k: int, device: str) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x_wide = torch.randn(m, k + 5, generator=g)
    x = x_wide[:, 2 : 2 + k]  # a strided view, as a split of a fused projection is
    w = torch.randn(n, k, generator=g)
    got = skinny_linear(x.to(device), w.to(device))
    torch.testing.assert_close(got.cpu(), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_skinny_linear_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="must be"):
        skinny_linear(torch.zeros(2, 8), torch.zeros(4, 7))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("n,k", [(2048, 2048), (576, 2048), (163840, 2048), (2048, 11264)])
def test_skinny_linear_bf16_on_the_gpu(m: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    want = F.linear(x.float(), w.float())
    got = skinny_linear(x, w).float()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()
