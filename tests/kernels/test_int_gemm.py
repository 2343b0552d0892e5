"""The packed-INT matmul (ember/kernels/int_gemm.py) against its references on fresh random
weights packed by compressed-tensors: `int_matmul_ref` (ember's dequantize-then-F.linear) and
compressed-tensors' own unpack and `dequantize` then a matmul. fp32 activations and small tiles
in the interpreter (bits 4 and 8, groups 32 / 64 / 128 / channel-wise, with and without zero
points, all three kernels, split K, dims no tile divides); bf16 at real shapes, CUDA graphs and
the compiled variants on a GPU.

Tolerances: fp32 activations meet the references within 1e-5 of the output's largest magnitude
(the tensor-core kernels' weights are the references' bit for bit; only the order of the fp32
sums differs). bf16 activations: within 1e-2 of it (the output's own bf16 rounding, 2**-8
relative, dominates).

The CUDA-core GEMV multiplies the exact integers q - z by x in fp32 and each group's sum by its
scale once, so its weights are never rounded to x's dtype as the reference's are: it is held to
being at least as close as the reference to the exact product (float64, of the weight (q - z) *
scale and x as stored) wherever the reference rounds its weights (16-bit activations or scales):
its root-mean-square error at most the reference's, its largest error at most the reference's
plus half a unit in the last place of the output's largest magnitude (one final rounding may land
the other way). fp32 activations and scales (the reference's weights exact in fp32 too, so the
two round alike): both within 1e-5, as above.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize

from ember.kernels import int_gemm
from ember.kernels.int_gemm import CORE_MAX_ROWS, GEMV_MAX_ROWS, int_matmul, kernel_for
from ember.kernels.quant_ref import dequantize_int, int_matmul_ref, unpack_int, unpack_int_rows

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# The smallest tiles the kernels take (BLOCK_K: 16 fields of every word, each plane's dot has
# K >= 16; the CUDA-core GEMV: 8 words, two chunks, a step), so the interpreter's small weights
# still span several column tiles and K steps.
def _small(bits: int, kernel: str, **over: int) -> dict[str, int]:
    if kernel == "core_gemv":
        tiles = {"BLOCK_N": 8, "BLOCK_KW": 8, "SPLIT_K": 1, "num_warps": 1, "num_stages": 1}
        return tiles | over
    tiles = {"BLOCK_N": 16, "BLOCK_K": 512 // bits, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1}
    if kernel == "gemm":
        tiles |= {"BLOCK_M": 16, "GROUP_M": 2}
    return tiles | over


# K per group size, with BLOCK_K 128 (int4) / 64 (int8): 32 and 64 take several groups a step
# (int4) and a K that ends mid-step; 128 one group a step; channel-wise a K that leaves the
# rows' last word part-filled.
K_FOR_GROUP = {32: 160, 64: 192, 128: 256, "channel": 203}


def _weight(
    n: int,
    k: int,
    bits: int,
    group: int | str,
    asym: bool,
    scale_dtype: torch.dtype,
    g: torch.Generator,
):
    """Random q, packed by compressed-tensors; scales; zero points packed down the rows as
    compressed-tensors stores them and unpacked as ember loads them."""
    group_size = k if group == "channel" else group
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    packed = pack_to_int32(q, bits)
    scale = (torch.rand(n, k // group_size, generator=g) * 0.04 + 0.002).to(scale_dtype)
    zero_point = None
    if asym:
        zp = torch.randint(lo, hi, (n, k // group_size), generator=g, dtype=torch.int8)
        zero_point = unpack_int_rows(pack_to_int32(zp, bits, packed_dim=0), bits, n)
        assert torch.equal(zero_point, zp)
    return packed, scale, zero_point, group_size


def _ct_matmul(x, packed, scale, zero_point, bits, group, n, k):
    """compressed-tensors' unpack and dequantize of the same weight, then an fp32 matmul."""
    q = unpack_from_int32(packed, bits, torch.Size([n, k]))
    if group == "channel":
        args = QuantizationArgs(num_bits=bits, symmetric=zero_point is None, strategy="channel")
    else:
        args = QuantizationArgs(
            num_bits=bits, symmetric=zero_point is None, strategy="group", group_size=group
        )
    w = dequantize(q, scale, zero_point, args=args)
    return x.float() @ w.float().T


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    got, want = got.float().cpu(), want.float().cpu()
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), f"{err} > {tol} * {want.abs().max().item()}"


# Every (bits, group, zero point) through every kernel; M runs through 1..4 (the CUDA-core
# GEMV), 1, 5, 16 (the tensor-core GEMV, which `kernel` may also give fewer rows) and 17, 40
# (the GEMM) across the cases.
KERNEL_ROWS = {"core_gemv": (1, 2, 3, 4), "tc_gemv": (1, 5, 16), "gemm": (17, 40)}
CASES = [
    (bits, group, asym, kernel, ms[i % len(ms)])
    for i, (bits, group, asym) in enumerate(
        (b, gr, a) for b in (4, 8) for gr in (32, 64, 128, "channel") for a in (False, True)
    )
    for kernel, ms in KERNEL_ROWS.items()
]


@pytest.mark.parametrize(
    "bits,group,asym,kernel,m",
    CASES,
    ids=[f"int{b}-g{gr}-{'asym' if a else 'sym'}-{kn}-m{m}" for b, gr, a, kn, m in CASES],
)
def test_int_matmul_matches_the_references(
    bits: int, group: int | str, asym: bool, kernel: str, m: int, device: str
) -> None:
    g = torch.Generator().manual_seed(bits * 100 + m)
    n, k = 40, K_FOR_GROUP[group]
    packed, scale, zero_point, group_size = _weight(n, k, bits, group, asym, torch.float32, g)
    x = torch.randn(m, k, generator=g)
    config = _small(bits, kernel, SPLIT_K=1 if kernel == "gemm" else 2)
    on = [t.to(device) if t is not None else None for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, bits, group_size, config=config, kernel=kernel)
    assert got.shape == (m, n) and got.dtype == x.dtype
    _close(got, int_matmul_ref(x, packed, scale, zero_point, bits, group_size), 1e-5)
    _close(got, _ct_matmul(x, packed, scale, zero_point, bits, group, n, k), 1e-5)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 40])
@pytest.mark.parametrize("split", [1, 3])
def test_every_batch_size_and_split(m: int, split: int, device: str) -> None:
    """int4, groups of 32, zero points and fp16 scales (the tensor-core kernels' one-fma
    dequantization): the K range cut in 1 or 3 splits (the partial sums and their fixed-order
    reduction) in every kernel M picks, and GEMM row tiles of a partial launch group."""
    g = torch.Generator().manual_seed(m + 7 * split)
    n, k = 40, 352
    packed, scale, zero_point, group_size = _weight(n, k, 4, 32, True, torch.float16, g)
    x = torch.randn(m, k, generator=g)
    config = _small(4, kernel_for(m), SPLIT_K=split)
    on = [t.to(device) for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, 4, group_size, config=config)
    ref = int_matmul_ref(x, packed, scale, zero_point, 4, group_size)
    if kernel_for(m) == "core_gemv":  # the reference rounds each weight to fp16, it does not
        _at_least_as_close(got, ref, _exact(x, packed, scale, zero_point, 4, group_size))
    else:
        _close(got, ref, 1e-5)


def test_which_kernel_takes_which_rows(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """1..CORE_MAX_ROWS rows take the CUDA-core GEMV, then up to GEMV_MAX_ROWS the tensor-core
    GEMV, then the GEMM; `kernel` overrides within each kernel's rows; no rows launch nothing."""
    assert [kernel_for(m) for m in (1, CORE_MAX_ROWS, CORE_MAX_ROWS + 1, GEMV_MAX_ROWS)] == [
        "core_gemv",
        "core_gemv",
        "tc_gemv",
        "tc_gemv",
    ]
    assert kernel_for(GEMV_MAX_ROWS + 1) == "gemm"
    launched: list[str] = []

    class Spy:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name, attr in (
        ("core_gemv", "_core_gemv_kernel"),
        ("tc_gemv", "_int_gemv_kernel"),
        ("gemm", "_int_gemm_kernel"),
    ):
        monkeypatch.setattr(int_gemm, attr, Spy(name, getattr(int_gemm, attr)))
    g = torch.Generator().manual_seed(1)
    packed, scale, _, group_size = _weight(24, 64, 4, 32, False, torch.float32, g)
    packed, scale = packed.to(device), scale.to(device)

    def run(m: int, **kw: str) -> torch.Tensor:
        x = torch.randn(m, 64, generator=g).to(device)
        return int_matmul(x, packed, scale, None, 4, group_size, **kw)

    for m in (0, 1, CORE_MAX_ROWS, CORE_MAX_ROWS + 1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        launched.clear()
        assert run(m).shape == (m, 24)
        assert launched == ([kernel_for(m)] if m else []), (m, launched)
    launched.clear()
    run(2, kernel="tc_gemv")
    run(2, kernel="gemm")
    assert launched == ["tc_gemv", "gemm"]
    with pytest.raises(ValueError, match="'core_gemv' does not take 5 rows"):
        run(5, kernel="core_gemv")
    with pytest.raises(ValueError, match="'tc_gemv' does not take 17 rows"):
        run(17, kernel="tc_gemv")
    with pytest.raises(ValueError, match="'gemv' does not take"):
        run(1, kernel="gemv")


def _exact(x: torch.Tensor, packed, scale, zero_point, bits: int, group_size: int) -> torch.Tensor:
    """x @ W.T in float64 for the real weight (q - z) * scale, scale and x as stored: what the
    kernels and the reference approximate."""
    k = x.shape[1]
    q = unpack_int(packed, bits, k).double()
    if zero_point is not None:
        q = q - zero_point.double().repeat_interleave(group_size, -1)[..., :k]
    w = q * scale.double().repeat_interleave(group_size, -1)[..., :k]
    return x.double() @ w.T


def _at_least_as_close(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> None:
    """got's error against the exact product no larger than ref's: in root mean square, and at
    most by half an ulp of the output's largest magnitude (one final rounding) in the largest."""
    got_err = (got.double().cpu() - exact.cpu()).abs()
    ref_err = (ref.double().cpu() - exact.cpu()).abs()
    rms = [e.square().mean().sqrt().item() for e in (got_err, ref_err)]
    assert rms[0] <= rms[1], f"rms error {rms[0]} > the reference's {rms[1]}"
    half_ulp = exact.abs().max().item() * torch.finfo(got.dtype).eps / 2
    most = got_err.max().item(), ref_err.max().item()
    assert most[0] <= most[1] + half_ulp, f"largest error {most[0]} > the reference's {most[1]}"


# Every (bits, group, zero point) through the CUDA-core GEMV with 16-bit activations and scales;
# M runs through 1..CORE_MAX_ROWS across the cases.
CORE_HALF_CASES = [
    (bits, group, asym, 1 + i % CORE_MAX_ROWS)
    for i, (bits, group, asym) in enumerate(
        (b, gr, a) for b in (4, 8) for gr in (32, 64, 128, "channel") for a in (False, True)
    )
]


@pytest.mark.parametrize(
    "bits,group,asym,m",
    CORE_HALF_CASES,
    ids=[f"int{b}-g{gr}-{'asym' if a else 'sym'}-m{m}" for b, gr, a, m in CORE_HALF_CASES],
)
def test_core_gemv_is_at_least_as_close_as_the_reference(
    bits: int, group: int | str, asym: bool, m: int, device: str
) -> None:
    """fp16 activations and scales, where the reference rounds each weight to fp16 and the
    kernel does not. (bf16 is checked on a GPU: the interpreter truncates fp32 to bf16 where the
    GPU rounds to nearest even.)"""
    g = torch.Generator().manual_seed(bits + m)
    n, k = 48, 407 if group == "channel" else 512
    packed, scale, zero_point, group_size = _weight(n, k, bits, group, asym, torch.float16, g)
    x = torch.randn(m, k, generator=g).to(torch.float16)
    on = [t.to(device) if t is not None else None for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, bits, group_size, config=_small(bits, "core_gemv", SPLIT_K=2))
    ref = int_matmul_ref(x, packed, scale, zero_point, bits, group_size)
    _at_least_as_close(got, ref, _exact(x, packed, scale, zero_point, bits, group_size))


@pytest.mark.parametrize("m", [1, 3])
def test_core_gemv_leaves_rows_past_m_alone(m: int, device: str) -> None:
    """The kernel writes rows 0..M-1 of its output (the four-row loop runs three rows as four,
    the fourth a copy of the third), here straight into a buffer of CORE_MAX_ROWS rows."""
    g = torch.Generator().manual_seed(m)
    n, k = 20, 256
    packed, scale, _, group_size = _weight(n, k, 4, 128, False, torch.float32, g)
    x = torch.randn(m, k, generator=g)
    y = torch.full((CORE_MAX_ROWS, n), float("nan"))
    x, packed, scale, y = (t.to(device) for t in (x, packed, scale, y))
    int_gemm._core_gemv_kernel[(3, 1)](
        x, packed, scale, scale, y, m, n, k, packed.shape[1], packed.shape[1], int_gemm.MAGIC_BITS,
        *x.stride(), *packed.stride(), *scale.stride(), *scale.stride(),
        BITS=4, GROUP_SIZE=128, HAS_ZP=False, PARTIAL=False, EVEN=False, BLOCK_N=8,
        BLOCK_KW=8, STAGES=1,
    )  # fmt: skip
    _close(y[:m], int_matmul_ref(x, packed, scale, None, 4, group_size), 1e-5)
    assert y[m:].isnan().all()


@pytest.mark.parametrize("m", [2, 24])
def test_default_tiles(m: int, device: str) -> None:
    """The tiles int_matmul picks itself: BLOCK_N and BLOCK_K past N and K, masked."""
    g = torch.Generator().manual_seed(m)
    n, k = 24, 96
    packed, scale, zero_point, group_size = _weight(n, k, 8, 32, False, torch.float32, g)
    x = torch.randn(m, k, generator=g)
    on = [t.to(device) if t is not None else None for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, 8, group_size)
    _close(got, int_matmul_ref(x, packed, scale, zero_point, 8, group_size), 1e-5)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_weights_are_the_references_bit_for_bit(
    bits: int, scale_dtype: torch.dtype, x_dtype: torch.dtype, device: str
) -> None:
    """x = I reads every weight out alone (one product, exact): the kernel's dequantized weight,
    rounded to the scale's dtype then x's, equals dequantize_int's. (bf16 is checked on a GPU:
    the interpreter truncates fp32 to bf16 where the GPU rounds to nearest even.)"""
    g = torch.Generator().manual_seed(bits)
    n, k = 24, 64
    packed, scale, zero_point, group_size = _weight(n, k, bits, 32, True, scale_dtype, g)
    scale = scale * torch.where(torch.rand(scale.shape, generator=g) < 0.5, -1, 1).to(scale_dtype)
    x = torch.eye(k, dtype=x_dtype)
    on = [t.to(device) for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, bits, group_size, config=_small(bits, "gemm"))
    want = dequantize_int(packed, scale, zero_point, bits, group_size, k, x_dtype).T
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("kernel", ["core_gemv", "tc_gemv"])
def test_a_row_of_a_larger_buffer(kernel: str, device: str) -> None:
    """x with a row stride wider than K (a graph's static input, a slice)."""
    g = torch.Generator().manual_seed(5)
    n, k = 20, 128
    packed, scale, zero_point, group_size = _weight(n, k, 4, 64, False, torch.float32, g)
    buf = torch.randn(4, 2 * k, generator=g)
    x = buf[1:3, :k]
    on = [t.to(device) if t is not None else None for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, 4, group_size, config=_small(4, kernel), kernel=kernel)
    _close(got, int_matmul_ref(x, packed, scale, zero_point, 4, group_size), 1e-5)


def test_core_gemv_takes_strided_columns_of_x(device: str) -> None:
    """x whose elements are not adjacent (every other column of a buffer): the CUDA-core GEMV
    reads x through its strides, with no 16-byte loads to lean on."""
    g = torch.Generator().manual_seed(6)
    n, k = 20, 192
    packed, scale, zero_point, group_size = _weight(n, k, 4, 64, True, torch.float32, g)
    x = torch.randn(3, 2 * k, generator=g)[:, ::2]
    on = [t.to(device) for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, 4, group_size, config=_small(4, "core_gemv"))
    _close(got, int_matmul_ref(x, packed, scale, zero_point, 4, group_size), 1e-5)


def test_no_rows_returns_an_empty_output(device: str) -> None:
    packed, scale, _, group_size = _weight(8, 64, 4, 32, False, torch.float32, torch.Generator())
    x = torch.empty(0, 64, device=device)
    got = int_matmul(x, packed.to(device), scale.to(device), None, 4, group_size)
    assert got.shape == (0, 8) and got.dtype == x.dtype


def test_shapes_that_do_not_fit_raise() -> None:
    g = torch.Generator().manual_seed(0)
    packed, scale, zp, _ = _weight(8, 64, 4, 32, True, torch.float32, g)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="4 or 8"):
        int_matmul(x, packed, scale, zp, 3, 32)
    with pytest.raises(ValueError, match=r"does not hold rows of K = 96"):
        int_matmul(torch.randn(2, 96), packed, scale, zp, 4, 32)
    with pytest.raises(ValueError, match=r"want \[N, 16\]"):
        int_matmul(x, packed, scale, zp, 8, 32)  # int4 words read as int8
    with pytest.raises(ValueError, match="group_size 48 must be K = 64 .* or a power of two"):
        int_matmul(x, packed, scale, zp, 4, 48)
    with pytest.raises(ValueError, match="group_size 16 must be"):
        int_matmul(x, packed, torch.ones(8, 4), None, 4, 16)  # below MIN_GROUP
    with pytest.raises(ValueError, match="group_size 128 must be"):
        int_matmul(x, packed, torch.ones(8, 1), None, 4, 128)  # does not divide K
    tc = {"kernel": "tc_gemv"}
    with pytest.raises(ValueError, match="BLOCK_K at least 128 at 4 bits"):
        int_matmul(x, packed, scale, zp, 4, 32, config=_small(4, "tc_gemv", BLOCK_K=64), **tc)
    with pytest.raises(ValueError, match="powers of two"):
        int_matmul(x, packed, scale, zp, 4, 32, config=_small(4, "tc_gemv", BLOCK_N=24), **tc)
    with pytest.raises(ValueError, match="the tc_gemv kernel's are"):
        int_matmul(x, packed, scale, zp, 4, 32, config=_small(4, "gemm"), **tc)
    with pytest.raises(ValueError, match="the core_gemv kernel's are"):
        int_matmul(x, packed, scale, zp, 4, 32, config=_small(4, "tc_gemv"))  # 2 rows: core
    with pytest.raises(ValueError, match="the tc_gemv kernel's are"):
        int_matmul(x, packed, scale, zp, 4, 32, config=_small(4, "tc_gemv", maxnreg=128), **tc)
    with pytest.raises(ValueError, match="BLOCK_KW at least 4"):
        int_matmul(x, packed, scale, zp, 4, 32, config=_small(4, "core_gemv", BLOCK_KW=2))
    with pytest.raises(ValueError, match="must be powers of two"):
        int_matmul(x, packed, scale, zp, 4, 32, config=_small(4, "core_gemv", BLOCK_N=12))
    with pytest.raises(ValueError, match=r"scale must be .* \(8, 2\)"):
        int_matmul(x, packed, scale[:, :1], zp, 4, 32)
    with pytest.raises(ValueError, match="scale must be"):
        int_matmul(x, packed, scale.double(), zp, 4, 32)
    with pytest.raises(ValueError, match="zero_point must be int8"):
        int_matmul(x, packed, scale, zp.to(torch.int32), 4, 32)
    with pytest.raises(ValueError, match=r"zero_point must be int8 \(8, 2\)"):
        int_matmul(x, packed, scale, zp[:4], 4, 32)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        int_matmul(x[None], packed, scale, zp, 4, 32)
    with pytest.raises(ValueError, match="packed must be int32"):
        int_matmul(x, packed.to(torch.int64), scale, zp, 4, 32)


# On a GPU: bf16 at real shapes (Llama-8B's projections and Moonlight's experts), both kernels.
GPU_CASES = [
    # (m, n, k, bits, group, asym)
    (1, 4096, 4096, 4, 128, False),
    (1, 6144, 4096, 4, 32, True),
    (1, 2048, 1408, 4, 32, False),
    (5, 1024, 4096, 4, 32, False),  # split K
    (7, 2816, 2048, 8, "channel", False),
    (16, 4096, 14336, 4, 128, True),
    (17, 4096, 4096, 8, 128, False),
    (200, 6144, 4096, 4, 128, True),
    (1000, 2816, 2048, 4, 32, False),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,n,k,bits,group,asym", GPU_CASES)
def test_bf16_real_shapes(m: int, n: int, k: int, bits: int, group: int | str, asym: bool) -> None:
    g = torch.Generator().manual_seed(m)
    packed, scale, zero_point, group_size = _weight(n, k, bits, group, asym, torch.bfloat16, g)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    on = [t.cuda() if t is not None else None for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, bits, group_size)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    _close(got, int_matmul_ref(*on, bits, group_size), 1e-2)
    # The same bf16 weights multiplied in fp64: what both approximate.
    w = dequantize_int(*on[1:], bits, group_size, k, torch.bfloat16)
    _close(got, on[0].double() @ w.double().T, 1e-2)


# The CUDA-core GEMV at Llama-8B's projections (q/k/v, o, gate/up, down) and Moonlight's experts,
# 1..4 rows of bf16.
CORE_GPU_CASES = [
    # (m, n, k, bits, group, asym)
    (1, 4096, 4096, 4, 128, False),
    (2, 6144, 4096, 4, 32, True),
    (3, 28672, 4096, 4, 128, False),
    (4, 4096, 14336, 4, 128, True),
    (1, 2816, 2048, 4, 32, False),
    (2, 2048, 1408, 4, 32, False),  # K in no whole steps: masked
    (3, 1024, 4096, 4, 128, False),  # split K
    (3, 4096, 4096, 8, "channel", True),
    (4, 6144, 4096, 8, 128, False),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m,n,k,bits,group,asym", CORE_GPU_CASES)
def test_core_gemv_bf16_real_shapes(
    m: int, n: int, k: int, bits: int, group: int | str, asym: bool
) -> None:
    """Within 1e-2 of the reference, and at least as close as it to the exact product."""
    assert kernel_for(m) == "core_gemv"
    g = torch.Generator().manual_seed(m + n)
    packed, scale, zero_point, group_size = _weight(n, k, bits, group, asym, torch.bfloat16, g)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    on = [t.cuda() if t is not None else None for t in (x, packed, scale, zero_point)]
    got = int_matmul(*on, bits, group_size)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    ref = int_matmul_ref(*on, bits, group_size)
    _close(got, ref, 1e-2)
    _at_least_as_close(got, ref, _exact(*on, bits, group_size))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_dequantized_weights_bit_for_bit(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    n, k = 192, 256
    packed, scale, zero_point, group_size = _weight(n, k, bits, 64, True, torch.bfloat16, g)
    x = torch.eye(k, dtype=torch.bfloat16)
    on = [t.cuda() for t in (x, packed, scale, zero_point)]
    want = dequantize_int(*on[1:], bits, group_size, k, torch.bfloat16).T
    assert torch.equal(int_matmul(*on, bits, group_size), want)  # the GEMM
    assert torch.equal(int_matmul(on[0][:16], *on[1:], bits, group_size), want[:16])  # the GEMV


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 2048, 1408), (3, 1024, 4096), (4, 6144, 4096), (9, 1024, 4096), (64, 4096, 4096)],
)
def test_cuda_graph_replay_matches_eager(m: int, n: int, k: int) -> None:
    """Captured once, replayed on new inputs: the output of an eager call on the same inputs,
    bit for bit (split-K's reduction is in a fixed order). The CUDA-core GEMV (1, 3 with split
    K, 4 rows), the tensor-core GEMV (9, split K) and the GEMM."""
    g = torch.Generator().manual_seed(m)
    packed, scale, zero_point, group_size = _weight(n, k, 4, 32, True, torch.bfloat16, g)
    packed, scale, zero_point = packed.cuda(), scale.cuda(), zero_point.cuda()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    int_matmul(x, packed, scale, zero_point, 4, group_size)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = int_matmul(x, packed, scale, zero_point, 4, group_size)
    for seed in range(3):
        x.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, int_matmul(x, packed, scale, zero_point, 4, group_size))


@pytest.mark.gpu
@needs_cuda
def test_one_compiled_variant_serves_every_batch_size() -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 4096, 4096
    packed, scale, _, group_size = _weight(n, k, 4, 128, False, torch.bfloat16, g)
    packed, scale = packed.cuda(), scale.cuda()

    def variants(kernel) -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    kernels = (int_gemm._core_gemv_kernel, int_gemm._int_gemv_kernel, int_gemm._int_gemm_kernel)
    before = [variants(kernel) for kernel in kernels]
    for m in (1, 2, 3, 4, 5, 8, 13, 16, 17, 33, 100, 128, 129, 300, 1000):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        int_matmul(x, packed, scale, None, 4, group_size)
    after = [variants(kernel) for kernel in kernels]
    assert after[0] - before[0] <= 1  # the CUDA-core GEMV: one for all of 1..4
    assert after[1] - before[1] <= 1  # the tensor-core GEMV: one for all of 5..16
    assert after[2] - before[2] <= 2  # the GEMM: one a bucket of gemm_config
