"""The FP8 kernels (ember/kernels/fp8_gemm.py) against quant_ref's plain-PyTorch math on random
inputs: activation quantization bit for bit (zero rows, large and tiny values, exact ties, groups
longer than one pass); the GEMM for DeepSeek-V3's (128, 128) blocks, channel-wise (1, K) weights,
W8A8 and weight-only, batch sizes around the 16-row tile, and N, K that no tile or block divides.
Weights are random floats quantized per block (scale = amax / 448), as checkpoints are. Small
tiles and fp32 in the interpreter (its dot cannot take bf16); bf16 at DeepSeek-V3's shapes and
CUDA-graph capture on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.kernels import fp8_gemm, fp8_gemv
from ember.kernels.fp8_gemm import fp8_matmul, quantize_fp8_groups, tile_config
from ember.kernels.quant_ref import FP8_MAX, fp8_matmul_ref
from ember.kernels.quant_ref import quantize_fp8_groups as quantize_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Small tiles so the interpreter's shapes still span several row, column and K tiles. BLOCK_K 32:
# the least an fp8 dot takes on a GPU, and four steps to each 128-wide scale block.
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}

N, K = 200, 300  # two 128-row blocks (the second partial), three 128-column ones (likewise)
ROW = -1  # in KINDS: the whole row, K
KINDS = {
    "block-w8a8": ((128, 128), 128),  # DeepSeek-V3 / Kimi K2
    "channel-w8a8": ((1, ROW), ROW),  # compressed-tensors FP8_DYNAMIC
    "block-weight-only": ((128, 128), 0),
    "channel-weight-only": ((1, ROW), 0),
    "mixed-widths": ((32, 64), 32),  # activation groups narrower than the weight's blocks
}


def kind_args(kind: str, k: int) -> tuple[tuple[int, int], int]:
    """(block, act_group) of a kind for rows of k."""
    (bn, bk), act_group = KINDS[kind]
    return (bn, k if bk == ROW else bk), k if act_group == ROW else act_group


def quantize_weight(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] as an FP8 checkpoint stores it: one scale per block (amax / 448)."""
    bn, bk = block
    n, k = w.shape
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax((1, 3)) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(padded.shape)[:n, :k].contiguous(), scale


def activations(m: int, k: int, g: torch.Generator, spread: int = 4) -> torch.Tensor:
    """Rows of very different magnitudes (10**-spread ... 10**spread), the first of two or more
    all zeros."""
    x = torch.randn(m, k, generator=g) * torch.logspace(-spread, spread, m)[:, None]
    if m > 1:
        x[0] = 0
    return x


def check(
    m: int,
    kind: str,
    dtype: torch.dtype,
    device: str,
    seed: int,
    config: dict[str, int] | None = SMALL,
    n: int = N,
    k: int = K,
) -> None:
    g = torch.Generator().manual_seed(seed)
    block, act_group = kind_args(kind, k)
    weight, scale = quantize_weight(torch.randn(n, k, generator=g), block)
    x = activations(m, k, g, spread=2).to(dtype)
    want = fp8_matmul_ref(x, weight, scale, block, act_group)
    # Tensor-core tiles (BLOCK_M) name the GEMM; anything else lets fp8_matmul choose.
    kernel = "gemm" if config and "BLOCK_M" in config else None
    got = fp8_matmul(
        x.to(device), weight.to(device), scale.to(device), block, act_group, config, kernel
    )
    assert got.shape == (m, n) and got.dtype == dtype
    got, want = got.float().cpu(), want.float()
    # fp32: equal up to the order of the fp32 sums (1e-5 of the row's scale). bf16 / fp16: both
    # round fp32 sums that differ so to x's dtype: one unit in the last place apart, which is
    # 2**-7 of a value at the bottom of its binade and 2**-6 of one rounded up across it (the
    # H200 met 16256 against 16384).
    rel = 1e-5 if dtype == torch.float32 else 2.0**-6
    err = (got - want).abs()
    bound = rel * want.abs() + 1e-5 * want.abs().amax(1, keepdim=True)
    assert (err <= bound).all(), f"max error {err.max().item():.3e}"


def check_exact(m: int, kind: str, seed: int, n: int, k: int) -> None:
    """bf16 at a model's shape on the GPU against the exact (float64) product of the operands
    the kernel multiplies (x quantized as the reference does, bit-equal to the kernel's; W
    dequantized), rounded once: within half a unit in bf16's last place (2**-8 of the value)
    plus the fp32 sums' rounding (bounded by the sum of the terms' magnitudes; the H200 met
    65.7 at a value of ~16,400 where half a unit is 64). Against the fp32 reference rounded to bf16, the two roundings
    may fall either side of a tie, one unit apart: 128 at 16384-32768, met on an H200 at 1,000
    rows, where `check`'s 2**-6 of a smaller value did not cover it."""
    from ember.kernels.quant_ref import dequantize_fp8, dequantize_fp8_groups

    g = torch.Generator().manual_seed(seed)
    block, act_group = kind_args(kind, k)
    weight, scale = quantize_weight(torch.randn(n, k, generator=g), block)
    x = activations(m, k, g, spread=2).to(torch.bfloat16)
    got = fp8_matmul(x.cuda(), weight.cuda(), scale.cuda(), block, act_group).double().cpu()
    if act_group:
        xf = dequantize_fp8_groups(*quantize_ref(x, act_group), act_group).double()
    else:
        xf = x.double()
    wf = dequantize_fp8(weight, scale, block, torch.float64)
    exact = xf @ wf.T
    # The sums' own rounding: each term passes through at most ~64 fp32 additions (a 128-wide
    # K step's dot, then one accumulation a step: 56 steps at K 7168), each within 2**-24; but
    # Hopper's fp8 wgmma (tiles of 64+ rows, W8A8) keeps ~14 bits while it sums a step
    # (DeepSeek-V3's report; the H200 met 65.7 at 1,000 rows where fp32 sums allow ~64).
    per_term = 2.0**-13 if act_group and m >= 64 else 64 * 2.0**-24
    sums = per_term * (xf.abs() @ wf.abs().T)
    err = (got - exact).abs()
    bound = 2.0**-8 * exact.abs() + sums
    assert (err <= bound).all(), f"max error {err.max().item():.3e}"


@pytest.mark.parametrize(
    "m,k,group,dtype",
    [
        (5, K, 128, torch.float32),  # partial last group
        (6, 256, 128, torch.bfloat16),
        (4, 96, 32, torch.float16),
        (3, K, K, torch.float32),  # per-token
        (3, 4100, 4100, torch.bfloat16),  # per-token, longer than one pass: read in chunks
        (2, 40, 128, torch.float32),  # one group wider than the row
    ],
)
def test_quantize_matches_the_reference_bit_for_bit(
    m: int, k: int, group: int, dtype: torch.dtype, device: str
) -> None:
    x = activations(m, k, torch.Generator().manual_seed(k + group)).to(dtype)
    x[-1, :7] = torch.tensor([3e4, -3e4, 1e-30, -1e-30, -0.0, 1e-6, -1e-6])  # large, tiny, -0
    q, scale = quantize_fp8_groups(x.to(device), group)
    want_q, want_scale = quantize_ref(x, group)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


def test_quantize_rounds_ties_to_even(device: str) -> None:
    """With max|x| = 448 the scale is 1: every e4m3 value and every midpoint between two comes
    through as torch rounds it (ties to even, subnormals included, signs kept)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([torch.tensor([448.0]), values, mids, -mids, torch.tensor([2.0**-10])])[None]
    q, scale = quantize_fp8_groups(x.to(device), x.shape[1])
    want_q, _ = quantize_ref(x, x.shape[1])
    assert scale.item() == 1.0
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 5, 16, 17, 33])
@pytest.mark.parametrize("kind", list(KINDS)[:4])
def test_fp8_matmul_matches_the_reference(m: int, kind: str, device: str) -> None:
    check(m, kind, torch.float32, device, seed=m)


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("block-w8a8", torch.bfloat16),
        ("channel-w8a8", torch.bfloat16),
        ("block-weight-only", torch.float16),
        ("channel-weight-only", torch.float16),
        ("block-weight-only", torch.bfloat16),
        ("mixed-widths", torch.float32),
    ],
)
def test_fp8_matmul_in_half_precision_and_other_widths(
    kind: str, dtype: torch.dtype, device: str
) -> None:
    if device == "cpu" and dtype == torch.bfloat16 and KINDS[kind][1] == 0:
        pytest.skip("Triton's interpreter multiplies bf16 as integers (it stores them as uint16)")
    check(5, kind, dtype, device, seed=7)


def test_fp8_matmul_default_tiles(device: str) -> None:
    """tile_config's tiles: K steps of 128 past the end of K, column tiles past N (masked)."""
    check(3, "block-w8a8", torch.float32, device, seed=8, config=None, n=72, k=200)


def test_fp8_matmul_takes_strided_activations(device: str) -> None:
    g = torch.Generator().manual_seed(9)
    weight, scale = quantize_weight(torch.randn(N, K, generator=g), (128, 128))
    wide = torch.randn(7, K + 20, generator=g)
    x = wide[:, 10 : K + 10]  # rows K + 20 apart
    got = fp8_matmul(
        wide.to(device)[:, 10 : K + 10],
        weight.to(device),
        scale.to(device),
        (128, 128),
        128,
        config=SMALL,
    )
    want = fp8_matmul_ref(x, weight, scale, (128, 128), 128)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_empty_batch_and_empty_k(device: str) -> None:
    weight = torch.zeros(N, K, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.ones(2, 3, device=device)
    x = torch.zeros(0, K, dtype=torch.bfloat16, device=device)
    for act_group in (128, 0):
        y = fp8_matmul(x, weight, scale, (128, 128), act_group)
        assert y.shape == (0, N) and y.dtype == torch.bfloat16
    q, s = quantize_fp8_groups(x, 128)
    assert q.shape == (0, K) and s.shape == (0, 3)
    empty_k = torch.zeros(N, 0, dtype=torch.float8_e4m3fn, device=device)
    y = fp8_matmul(torch.ones(3, 0, device=device), empty_k, scale[:, :0], (128, 128), 128)
    assert torch.equal(y.cpu(), torch.zeros(3, N))


def test_bad_shapes_raise() -> None:
    weight = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 3)
    x = torch.zeros(5, K)  # the GEMM's rows
    with pytest.raises(ValueError, match="must be \\[M, K\\], \\[N, K\\]"):
        fp8_matmul(torch.zeros(4, K + 1), weight, scale, (128, 128), 128)
    with pytest.raises(ValueError, match="must be \\[M, K\\]"):
        fp8_matmul(torch.zeros(2, 4, K), weight, scale, (128, 128), 128)
    with pytest.raises(ValueError, match="scale"):
        fp8_matmul(x, weight, torch.ones(2, 2), (128, 128), 128)
    with pytest.raises(ValueError, match="scale"):
        fp8_matmul(x, weight, scale, (1, K), K)  # channel-wise needs [N, 1]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul(x, weight.float(), scale, (128, 128), 128)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        fp8_matmul(x.to(torch.float64), weight, scale, (128, 128), 128)
    with pytest.raises(ValueError, match="act_group"):
        fp8_matmul(x, weight, scale, (128, 128), -1)
    with pytest.raises(ValueError, match="positive"):
        fp8_matmul(x, weight, scale, (0, 128), 128)
    # 48-wide blocks leave fp8 K steps of 16; weight-only dots take 16.
    scale48 = torch.ones(2, 7)
    with pytest.raises(ValueError, match="block \\(128, 48\\) with act_group 128"):
        fp8_matmul(x, weight, scale48, (128, 48), 128)
    with pytest.raises(ValueError, match="act_group 100"):
        fp8_matmul(x, weight, scale, (128, 128), 100)
    with pytest.raises(ValueError, match="group"):
        quantize_fp8_groups(x, 0)
    with pytest.raises(ValueError, match="kernel 'core_gemv' does not take 5 rows"):
        fp8_matmul(x, weight, scale, (128, 128), 128, kernel="core_gemv")
    with pytest.raises(ValueError, match="kernel 'core_gemv' does not take 1 rows"):
        fp8_matmul(x[:1], weight, scale, (128, 128), 100, kernel="core_gemv")
    with pytest.raises(ValueError, match="kernel 'tc'"):
        fp8_matmul(x[:1], weight, scale, (128, 128), 128, kernel="tc")
    with pytest.raises(ValueError, match="BLOCK_K 24"):
        fp8_matmul(x[:1], weight, scale, (128, 128), 128, config={**CORE_SMALL, "BLOCK_K": 24})


# The CUDA-core GEMV's small tiles: several column tiles and K steps (K = 300: the last masked).
CORE_SMALL = {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 1, "num_stages": 1}


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_core_gemv_matches_the_reference(m: int, kind: str, device: str) -> None:
    """1-4 rows on the CUDA cores: the reference's exact products (W8A8: e4m3 times e4m3) in
    fp32 sums of another order, so equal up to that order, as the GEMM."""
    check(m, kind, torch.float32, device, seed=40 + m, config=CORE_SMALL)


@pytest.mark.parametrize("split", [2, 5])
@pytest.mark.parametrize("kind", ["block-w8a8", "channel-weight-only"])
def test_core_gemv_splits_k(split: int, kind: str, device: str) -> None:
    """SPLIT_K: each split's fp32 sums, then a fixed-order sum (5 splits of 5 steps: some
    splits get one step, the last a masked one)."""
    check(3, kind, torch.float32, device, seed=50, config={**CORE_SMALL, "SPLIT_K": split})


def test_core_gemv_in_half_precision(device: str) -> None:
    for kind, dtype in (("block-w8a8", torch.bfloat16), ("channel-weight-only", torch.float16)):
        check(2, kind, dtype, device, seed=51, config=CORE_SMALL)


def test_core_gemv_default_tiles_and_choice(device: str) -> None:
    """fp8_matmul picks the CUDA-core GEMV up to CORE_MAX_ROWS rows with core_gemv_config's
    tiles (one 1024-wide step, masked past K = 200), the GEMM from there or where a scale's
    width along K is no multiple of 16."""
    check(2, "block-w8a8", torch.float32, device, seed=52, config=None, n=72, k=200)
    pick = fp8_gemv.core_gemv_config
    assert pick(576, 7168)["num_warps"] == 4 and pick(576, 7168)["BLOCK_K"] == 4096  # kv_a
    assert pick(4096, 7168)["num_warps"] == 2  # 1,024 column tiles
    assert pick(12288, 1536)["BLOCK_K"] == 512 and pick(7168, 8192)["BLOCK_K"] == 1024
    assert all(pick(n, 7168)["SPLIT_K"] == 1 for n in (576, 7168, 36864))
    assert fp8_gemv.fits_core(7168, (128, 128), 128)
    assert not fp8_gemv.fits_core(7168, (128, 128), 100)
    assert fp8_gemv.fits_core(100, (1, 100), 100)  # one scale along all of K


def test_tile_config_grows_with_the_batch() -> None:
    assert all(tile_config(m)["BLOCK_M"] == 16 for m in range(1, 17))
    assert tile_config(17)["BLOCK_M"] > 16
    assert tile_config(8192)["BLOCK_M"] == 128
    sizes = [tile_config(m)["BLOCK_M"] for m in range(1, 9000)]
    assert sizes == sorted(sizes) and len(set(sizes)) <= 4  # a few compiled variants per layer


# Weights [N, K] around DeepSeek-V3's hidden size of 7168.
GPU_SHAPES = [(7168, 2048), (2048, 7168), (4096, 7168)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 4, 7, 16, 64, 300, 2048])
def test_fp8_matmul_bf16_at_deepseek_shapes(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + n)
    weight, scale = quantize_weight(torch.randn(n, k, generator=g), (128, 128))
    x = torch.randn(m, k, generator=g).bfloat16()
    got = fp8_matmul(x.cuda(), weight.cuda(), scale.cuda(), (128, 128), 128).float().cpu()
    # The reference on the CPU: torch on CUDA divides by 448 as a multiply by 1/448, which can
    # move a scale's last bit and flip a rare fp8 code of the activations.
    want = fp8_matmul_ref(x, weight, scale, (128, 128), 128).float()
    assert (got - want).norm() / want.norm() < 2e-3
    assert (got - want).abs().max() <= 2.0**-6 * want.abs().max()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("m", [1, 3, 33, 1000])
def test_fp8_matmul_other_kinds_on_the_gpu(kind: str, m: int) -> None:
    check_exact(m, kind, seed=m, n=4096, k=7168)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("k,group", [(7168, 128), (7168, 7168), (18432, 18432), (2048, 2048)])
def test_quantize_bit_for_bit_on_the_gpu(k: int, group: int) -> None:
    """The hardware's cast and tl.div_rn against torch's CPU ops."""
    x = activations(64, k, torch.Generator().manual_seed(k)).bfloat16()
    q, scale = quantize_fp8_groups(x.cuda(), group)
    want_q, want_scale = quantize_ref(x, group)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["block-w8a8", "channel-w8a8", "block-weight-only"])
def test_fp8_matmul_is_captured_in_a_cuda_graph(kind: str) -> None:
    g = torch.Generator().manual_seed(10)
    k = 2048
    block, act_group = kind_args(kind, k)
    weight, scale = (t.cuda() for t in quantize_weight(torch.randn(1024, k, generator=g), block))
    x = torch.randn(300, k, generator=g).cuda().bfloat16()
    for m in (1, 300):
        fp8_matmul(x[:m], weight, scale, block, act_group)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_matmul(x[:m], weight, scale, block, act_group)
        x.copy_(torch.randn(300, k, generator=g).cuda().bfloat16())
        graph.replay()
        assert torch.equal(out, fp8_matmul(x[:m], weight, scale, block, act_group))


@needs_cuda
@pytest.mark.gpu
def test_batch_sizes_of_a_bucket_share_one_compiled_variant() -> None:
    g = torch.Generator().manual_seed(11)
    weight, scale = (
        t.cuda() for t in quantize_weight(torch.randn(512, 1024, generator=g), (128, 128))
    )
    x = torch.randn(16, 1024, generator=g).cuda().bfloat16()

    def variants() -> int:
        kernels = (fp8_gemm._fp8_gemm_kernel, fp8_gemm._quantize_kernel, fp8_gemv._core_gemv_kernel)
        return sum(len(entry[0]) for fn in kernels for entry in fn.device_caches.values())

    for m in (1, 5):  # the CUDA-core GEMV's rows and the GEMM's first bucket
        fp8_matmul(x[:m], weight, scale, (128, 128), 128)
    before = variants()
    for m in range(2, 17):
        fp8_matmul(x[:m], weight, scale, (128, 128), 128)
    assert variants() == before
