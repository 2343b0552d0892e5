"""The one-row GEMV against F.linear on fresh random inputs, and when the Linear layer takes it."""

from __future__ import annotations

import os

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


def _check_silu_pairs(inter: int, k: int, dtype: torch.dtype, device: str, tol: float) -> None:
    from ember.kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(inter + k)
    w = (torch.randn(2 * inter, k, generator=g) * 0.05).to(device, dtype)
    x = torch.randn(1, k, generator=g).to(device, dtype)
    got = gemv.gemv_silu(x, w)
    assert got.shape == (1, inter)
    assert torch.equal(got, silu_and_mul(gemv.gemv(x, w)))
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("inter", "k"), [(20, 1024), (37, 2048 + 96), (150, 576)], ids=["even", "odd-k-tail", "smollm2"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_silu_is_the_gemv_then_silu_and_mul_to_the_bit(
    inter: int, k: int, dtype: torch.dtype, device: str
) -> None:
    """SiLU-and-mul in the gate/up GEMV's epilogue: the bits of the GEMV followed by the
    activation kernel (odd widths: a program's last pair masked), close to the reference."""
    _check_silu_pairs(inter, k, dtype, device, 1e-4 if dtype == torch.float32 else 3e-2)
    with pytest.raises(ValueError, match="gate rows, then up rows"):
        gemv.gemv_silu(torch.randn(1, 64, device=device), torch.randn(7, 64, device=device))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_silu_llama3_8b_gate_up(dtype: torch.dtype) -> None:
    _check_silu_pairs(14336, 4096, dtype, "cuda", 5e-2)


def test_stacked_gate_up_takes_the_silu_epilogue_for_one_row_only(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    from ember.models.layers.activation import silu_and_mul

    if device == "cpu":
        monkeypatch.setenv("EMBER_TRITON_ON_CPU", "1")
    monkeypatch.setattr(gemv, "MIN_WEIGHT_ELEMENTS", 0)
    fused: list[tuple[int, ...]] = []
    real = gemv.gemv_silu
    monkeypatch.setattr(gemv, "gemv_silu", lambda x, w: fused.append(tuple(x.shape)) or real(x, w))
    gate_up = StackedLinear(64, {"gate": 16, "up": 16}).to(device)
    one, two = torch.randn(1, 64, device=device), torch.randn(2, 64, device=device)
    with torch.no_grad():
        want = silu_and_mul(F.linear(one, gate_up.weight))
        torch.testing.assert_close(gate_up.activated(silu_and_mul, one), want)
        assert fused == [(1, 64)]
        gate_up.activated(silu_and_mul, two)  # two rows: cuBLAS, then the activation kernel
        gate_up.activated(lambda h: silu_and_mul(h) * 2, one)  # not SiLU
        uneven = StackedLinear(64, {"gate": 16, "up": 8}).to(device)
        uneven.activated(silu_and_mul, one)  # not a gate/up pair of one width: the plain path
    assert fused == [(1, 64)]


def _greedy_one_row(
    path: str, device: str, kernel: str, fused: bool, monkeypatch
) -> tuple[list, int]:
    """(tokens and logprobs, calls of the fused `kernel`) of one request decoding alone (every
    step one row), every matmul through the GEMV, on the GPU's path (on the CPU: the
    interpreter, with the GPU's attention backend). `fused=False`: the epilogue off (SiLU-and-mul
    or the rotation in their own kernels after the GEMV)."""
    import ember.engine.core as engine_core
    from ember.attention.triton_backend import TritonAttentionBackend
    from ember.engine.config import EngineConfig
    from ember.engine.core import EngineCore
    from ember.engine.messages import EngineCoreRequest
    from ember.sampling_params import SamplingParams

    calls = [0]
    real = getattr(gemv, kernel)

    def counting(*args: object) -> torch.Tensor:
        calls[0] += 1
        return real(*args)

    with monkeypatch.context() as m:
        if device == "cpu":
            m.setenv("EMBER_TRITON_ON_CPU", "1")
            # (the CPU's own backend writes K and V itself: the rotation's epilogue needs this one)
            m.setattr(engine_core, "default_backend", lambda device: TritonAttentionBackend())
        m.setattr(gemv, "MIN_WEIGHT_ELEMENTS", 0)
        m.setattr(gemv, kernel, counting)
        if not fused and kernel == "gemv_silu":
            m.setattr(StackedLinear, "activated", lambda self, act, x: act(self(x)))
        elif not fused:
            m.setattr(gemv, "rope_usable", lambda *args: False)
        config = EngineConfig(
            model=path,
            device=device,
            dtype="float32" if device == "cpu" else "bfloat16",
            num_kv_blocks=64,
            block_size=4,
            max_model_len=128,
            max_num_batched_tokens=64,
        )
        core = EngineCore(config)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
        core.add_request(EngineCoreRequest("r", [5, 9, 14, 3, 7, 11], params, [], 8))
        out = []
        while core.has_unfinished_requests():
            for o in core.step():
                assert o.finish_reason != "error", o.stop_reason
                lps = [lp[0][1] for lp in o.new_logprobs or []]
                out += list(zip(o.new_token_ids, lps, strict=True))
        core.close()
    return out, calls[0]


def _check_fused_decode(path: str, device: str, kernel: str, monkeypatch) -> None:
    want, plain_calls = _greedy_one_row(path, device, kernel, False, monkeypatch)
    got, fused_calls = _greedy_one_row(path, device, kernel, True, monkeypatch)
    assert len(got) == 8 and got == want
    assert plain_calls == 0 and fused_calls > 0


EPILOGUES = ["gemv_silu", "gemv_qkv_rope"]
"""SiLU-and-mul in the gate/up GEMV; the rotation and the KV write in the q/k/v GEMV."""


@pytest.mark.parametrize("kernel", EPILOGUES)
def test_epilogue_decodes_the_same_tokens_and_logprobs(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """Greedy decoding of one sequence with the epilogue gives the unfused path's tokens and
    logprobs exactly (the tiny Llama, fp32, kernels in the interpreter)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter run is for machines without a GPU")
    _check_fused_decode(str(tiny_model_dir("llama")), "cpu", kernel, monkeypatch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", EPILOGUES)
def test_epilogue_decodes_the_same_tokens_and_logprobs_on_the_gpu(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """The same in bf16 on the GPU, CUDA graphs included."""
    _check_fused_decode(str(tiny_model_dir("llama")), "cuda", kernel, monkeypatch)
