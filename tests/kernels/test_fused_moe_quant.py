"""The fused MoE grouped GEMM over quantized experts (ember/kernels/fused_moe.py) against the
per-expert loop on fresh random inputs: packed INT4/INT8 experts (compressed-tensors' packing;
groups 32, 64 and channel-wise; with and without zero points) against routed_experts_ref on the
weights dequantized to x's dtype, and FP8 block experts (W8A8) against routed_experts_fp8_ref,
which quantizes the activations as the kernel does. Routes are random, all to one expert, or
leave experts empty. fp32 in the interpreter, bf16 on a GPU at Moonlight's INT4 and a reduced Kimi
K2's FP8 expert dims, CUDA graphs included.

INT experts at one and two tokens take the CUDA-core path (ember/kernels/fused_moe_decode.py),
which rounds no weight: besides the reference's 1e-5 in fp32, its distance to the float64 MLP
(weights dequantized in float64, no rounding anywhere) must be at most the reference's, in the
relative norm over the output (tolerance 1.0x), in fp16 and with bf16 scales; a tensor-core
config (one with BLOCK_M) still runs the grouped GEMM's unsorted blocks there."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from ember.kernels import fused_moe as fused_moe_module
from ember.kernels.fused_moe import (
    fused_moe_fp8,
    fused_moe_int,
    tile_config_fp8,
    tile_config_int,
)
from ember.kernels.fused_moe_decode import decode_config_int
from ember.kernels.quant_ref import FP8_MAX, dequantize_int, routed_experts_fp8_ref
from ember.models.layers.moe import routed_experts_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Small tiles so the interpreter's few rows still span several blocks and tiles per expert.
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
FP8_SMALL = {**SMALL, "BLOCK_K": 32}  # an fp8 tl.dot's least K on NVIDIA GPUs


def _route(kind: str, tokens: int, experts: int, top_k: int, g: torch.Generator):
    scores = torch.rand(tokens, experts, generator=g)
    if kind == "one-expert":  # every token's best expert is expert 3
        scores[:, 3] += 10
    elif kind == "empty-experts":  # only experts 0..top_k can win; the rest get no token
        scores[:, : top_k + 1] += 10
    elif kind != "random":
        raise AssertionError(kind)
    return torch.rand(tokens, top_k, generator=g) + 0.1, scores.topk(top_k, dim=-1).indices


def _int_experts(experts, n, k, bits, group, zero, dtype, g):
    """Random packed INT weights [E, n, k] with scales (and zero points) per group of k."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (experts, n, k), generator=g, dtype=torch.int8)
    groups = k // group
    # Scales for weights of about 1 / sqrt(k), so every layer's output is about x's size.
    scale = (torch.rand(experts, n, groups, generator=g) + 0.5) * (2.0 / (hi * k**0.5))
    zeros = None
    if zero:
        zeros = torch.randint(lo // 2, hi // 2 + 1, (experts, n, groups), generator=g)
        zeros = zeros.to(torch.int8)
    return pack_to_int32(q, bits), scale.to(dtype), zeros


def _check_int(shape, quant, kind, dtype, device, seed, config, tol, scale_dtype=None):
    """shape: (tokens, experts, top_k, hidden, inter); quant: (bits, group or 0, zero points);
    the scales in scale_dtype (x's dtype when None)."""
    scale_dtype = scale_dtype or dtype
    tokens, experts, top_k, hidden, inter = shape
    bits, group, zero = quant
    g = torch.Generator().manual_seed(seed)
    g13 = min(group, hidden) if group > 0 else hidden  # channel-wise: one scale a row
    g2 = min(group, inter) if group > 0 else inter
    p13, s13, z13 = _int_experts(experts, 2 * inter, hidden, bits, g13, zero, scale_dtype, g)
    p2, s2, z2 = _int_experts(experts, hidden, inter, bits, g2, zero, scale_dtype, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, chosen = _route(kind, tokens, experts, top_k, g)
    w13 = dequantize_int(p13, s13, z13, bits, g13, hidden, dtype)
    w2 = dequantize_int(p2, s2, z2, bits, g2, inter, dtype)
    want = routed_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), chosen)
    on = [t.to(device) if t is not None else None for t in (x, p13, s13, z13, p2, s2, z2)]
    got = fused_moe_int(*on, weights.to(device), chosen.to(device), bits, group, config=config)
    assert got.shape == x.shape and got.dtype == dtype
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


@pytest.mark.parametrize("tokens", [1, 2, 5, 40])
@pytest.mark.parametrize("zero", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 64, 0], ids=["g32", "g64", "channel"])
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_int_matches_the_per_expert_loop(
    bits: int, group: int, zero: bool, tokens: int, device: str
) -> None:
    """K tiles of 32: a group a tile (g32), two tiles a group (g64), a row's K (channel)."""
    config = {**SMALL, "BLOCK_N": 32, "BLOCK_K": 32}
    shape, quant = (tokens, 8, 3, 64, 64), (bits, group, zero)
    _check_int(shape, quant, "random", torch.float32, device, tokens, config, 1e-5)


@pytest.mark.parametrize("kind", ["one-expert", "empty-experts"])
@pytest.mark.parametrize("bits,group,zero", [(4, 32, True), (8, 0, False)])
def test_fused_moe_int_imbalanced_routes(
    bits: int, group: int, zero: bool, kind: str, device: str
) -> None:
    _check_int((40, 8, 2, 64, 32), (bits, group, zero), kind, torch.float32, device, 5, SMALL, 1e-5)


@pytest.mark.parametrize(
    "config",
    [{**SMALL, "BLOCK_K": 64}, {**SMALL, "BLOCK_K": 128, "BLOCK_N": 32}, None],
    ids=["two-groups-a-tile", "four-groups-a-tile", "default-tiles"],
)
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_int_k_tiles_of_several_groups(bits: int, config, device: str) -> None:
    """K tiles longer than a group (each tile reads several scales), the default tiles too
    (BLOCK_K past H and I, masked)."""
    _check_int(
        (5, 4, 2, 128, 64), (bits, 32, True), "random", torch.float32, device, 7, config, 1e-5
    )


def _int4_pairs_against_general(shape, group, dtype, device, config) -> None:
    """Symmetric INT4 with scales in x's dtype, two weights an instruction (the PTX on a GPU,
    its bits in Triton's ops in the interpreter), against the general unpacking (INT4_PAIRS 0)
    with the same tiles: the same weights bit for bit, so the same output."""
    tokens, experts, top_k, hidden, inter = shape
    g = torch.Generator().manual_seed(tokens + group)
    p13, s13, _ = _int_experts(experts, 2 * inter, hidden, 4, group or hidden, False, dtype, g)
    p2, s2, _ = _int_experts(experts, hidden, inter, 4, group or inter, False, dtype, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, chosen = _route("random", tokens, experts, top_k, g)
    on = [t.to(device) for t in (x, p13, s13, p2, s2, weights, chosen)]
    x, p13, s13, p2, s2, weights, chosen = on
    w13_kind = fused_moe_module._int_weights(
        "w13", p13, s13, None, p13.shape[:2] + (hidden,), 4, group
    )
    assert fused_moe_module.int4_pairs(w13_kind, dtype)  # the path under test is taken
    pairs = fused_moe_int(x, p13, s13, None, p2, s2, None, weights, chosen, 4, group, config)
    general = {**config, "INT4_PAIRS": 0}
    want = fused_moe_int(x, p13, s13, None, p2, s2, None, weights, chosen, 4, group, general)
    assert torch.equal(pairs, want), (pairs.float() - want.float()).abs().max().item()
    # And both against the float64 MLP on the dequantized weights.
    w13 = dequantize_int(p13.cpu(), s13.cpu(), None, 4, group or hidden, hidden, dtype).double()
    w2 = dequantize_int(p2.cpu(), s2.cpu(), None, 4, group or inter, inter, dtype).double()
    ref = routed_experts_ref(x.cpu().double(), w13, w2, weights.cpu().double(), chosen.cpu())
    err = (pairs.cpu().double() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), err


@pytest.mark.parametrize("tokens", [5, 40])
@pytest.mark.parametrize("group", [32, 64], ids=["g32", "g64"])
def test_fused_moe_int4_pairs_equal_the_general_unpacking(
    group: int, tokens: int, device: str
) -> None:
    """fp16 here (Triton 3.6's interpreter truncates to bf16); K tiles of two groups of 32 (a
    word of scales), of one group of 64 (half a word; the down projection's single group a
    row takes the general unpacking)."""
    config = {**SMALL, "BLOCK_N": 32, "BLOCK_K": 64}
    _int4_pairs_against_general((tokens, 8, 3, 128, 64), group, torch.float16, device, config)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    ],
    ids=["m16", "m32", "m64-k32", "m64", "m128"],
)
def test_fused_moe_int4_pairs_ptx_equals_the_general_unpacking(config, dtype) -> None:
    """The PTX path on the GPU's tiles, Moonlight's expert dims, 256 tokens."""
    shape = (256, 16, 6, MOONLIGHT["hidden"], MOONLIGHT["inter"])
    _int4_pairs_against_general(shape, 32, dtype, "cuda", config)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_int_bf16_scales_round_the_weights(bits: int) -> None:
    """fp32 x with bf16 scales: each weight rounded to bf16 (the scales' dtype) first, as
    compressed-tensors dequantizes, then to x's dtype. (GPU only: Triton 3.6's interpreter
    truncates fp32 to bf16 rather than rounding to nearest.)"""
    shape, quant = (5, 4, 2, 64, 32), (bits, 32, True)
    _check_int(shape, quant, "random", torch.float32, "cuda", 14, SMALL, 1e-5, torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_int_channelwise_as_a_layer_passes_it(bits: int, device: str) -> None:
    """group_size = H (a channel-wise layer's group for its gate/up): one scale a row for both
    projections, though I < H."""
    shape = (5, 4, 2, 64, 32)
    _check_int(shape, (bits, 64, False), "random", torch.float32, device, 12, SMALL, 1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_moe_int_channelwise_dims_no_tile_divides(bits: int, device: str) -> None:
    """Channel-wise scales with H 48 and I 36: K tiles and (for INT4's I) packed words part
    past the row's end."""
    _check_int((9, 6, 2, 48, 36), (bits, 0, True), "random", torch.float32, device, 8, SMALL, 1e-5)


# The CUDA-core path's small tiles: 16 gate/up columns, K steps of 128 (and 128 rows for down),
# so the shapes below leave partial steps, partial row tiles and K past the last group.
DECODE = {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "down": {"BLOCK_N": 128}}


def _int_case(shape, quant, kind, dtype, seed, scale_dtype=None, device="cpu"):
    """Random packed experts and a batch on `device`: (fused_moe_int's arguments, the reference,
    the float64 MLP)."""
    tokens, experts, top_k, hidden, inter = shape
    bits, group, zero = quant
    g = torch.Generator().manual_seed(seed)
    g13 = min(group, hidden) if group > 0 else hidden
    g2 = min(group, inter) if group > 0 else inter
    sdt = scale_dtype or dtype
    made = _int_experts(experts, 2 * inter, hidden, bits, g13, zero, sdt, g)
    made += _int_experts(experts, hidden, inter, bits, g2, zero, sdt, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    made += (x, *_route(kind, tokens, experts, top_k, g))
    p13, s13, z13, p2, s2, z2, x, weights, chosen = (
        t.to(device) if t is not None else None for t in made
    )

    def mlp(dt: torch.dtype, exact: bool) -> torch.Tensor:
        # exact: scales in float64 too, so no weight is rounded (quant_ref multiplies in the
        # scales' dtype).
        cast = (lambda s: s.double()) if exact else (lambda s: s)
        w13 = dequantize_int(p13, cast(s13), z13, bits, g13, hidden, dt)
        w2 = dequantize_int(p2, cast(s2), z2, bits, g2, inter, dt)
        return routed_experts_ref(x.to(dt), w13, w2, weights.to(dt), chosen)

    args = (x, p13, s13, z13, p2, s2, z2, weights, chosen, bits, group)
    return args, mlp(dtype, False), mlp(torch.float64, True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("zero", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 64, 0], ids=["g32", "g64", "channel"])
@pytest.mark.parametrize("bits", [4, 8])
def test_int_decode_matches_the_per_expert_loop(
    bits: int, group: int, zero: bool, tokens: int, device: str
) -> None:
    """H 192 (a partial K step for gate/up, a partial row tile for down), I 64 (down's K short of
    a step): fp32, within 1e-5 of the reference."""
    shape, quant = (tokens, 8, 3, 192, 64), (bits, group, zero)
    args, want, _ = _int_case(shape, quant, "random", torch.float32, 20 + tokens, device=device)
    got = fused_moe_int(*args, DECODE)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize(
    "quant,kind",
    [((4, 0, True), "one-expert"), ((8, 0, False), "empty-experts"), ((4, 32, True), "random")],
)
@pytest.mark.parametrize("tokens", [1, 2])
def test_int_decode_dims_no_tile_divides(quant, kind: str, tokens: int, device: str) -> None:
    """H 48, I 36 channel-wise (INT4's I ends mid-word; gate/up's columns end mid-tile), and
    H 96, I 32 in groups of 32; routes all to one expert or to few."""
    shape = (tokens, 6, 2, 48, 36) if quant[1] == 0 else (tokens, 6, 2, 96, 32)
    args, want, _ = _int_case(shape, quant, kind, torch.float32, 30 + tokens, device=device)
    got = fused_moe_int(*args, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2})
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("target", [0, 1, 1000], ids=["whole-k", "split", "a-split-a-step"])
@pytest.mark.parametrize("bits,zero", [(4, False), (8, True)])
def test_int_decode_splits_k(bits: int, zero: bool, target: int, device: str) -> None:
    """SPLIT_TARGET (warps an SM, against 132 SMs in the interpreter) splits K: not at all, in 3
    (16 programs, 8 steps), a step a split; gate/up then adds its splits in a launch of its own."""
    shape, quant = (2, 4, 2, 256, 128), (bits, 32, zero)
    args, want, _ = _int_case(shape, quant, "random", torch.float32, 40, device=device)
    config = {"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "SPLIT_TARGET": target}
    got = fused_moe_int(*args, config)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize(
    "bits,group,zero", [(4, 32, False), (4, 0, True), (8, 64, True)], ids=["g32", "ch-asym", "i8"]
)
def test_int_decode_fp16_is_as_close_to_float64_as_the_reference(
    bits: int, group: int, zero: bool, device: str
) -> None:
    """fp16 x and scales (x read as int64 words of four): the reference rounds every weight to
    fp16; the kernel rounds none, so its output is no further from the float64 MLP."""
    shape, quant = (2, 8, 4, 256, 128), (bits, group, zero)
    args, want, exact = _int_case(shape, quant, "random", torch.float16, 50, device=device)
    got = fused_moe_int(*args, DECODE)
    assert got.dtype == torch.float16
    assert _rel(got, exact) <= _rel(want, exact)


@pytest.mark.parametrize("bits", [4, 8])
def test_int_decode_bf16_scales_with_fp32_x_round_no_weight(bits: int, device: str) -> None:
    """fp32 x, bf16 scales: the reference's weights are rounded to bf16 (as compressed-tensors
    dequantizes), the kernel's are not: it is within fp32 rounding of the float64 MLP, and the
    reference no nearer."""
    shape, quant = (2, 8, 3, 192, 64), (bits, 32, True)
    args, want, exact = _int_case(shape, quant, "random", torch.float32, 60, torch.bfloat16, device)
    got = fused_moe_int(*args, DECODE)
    assert _rel(got, exact) <= min(1e-5, _rel(want, exact))


def test_int_decode_reads_bf16_x_as_words(device: str) -> None:
    """bf16 x and scales: x read as int64 words of four bf16 values. Within 5e-2 of the
    reference: the interpreter truncates to bf16 where a GPU rounds, ~3% off over the MLP's seven
    roundings here (the GPU tests hold bf16 to the float64 MLP); a misread x is ~100% off."""
    shape, quant = (2, 8, 3, 192, 64), (4, 32, False)
    args, want, _ = _int_case(shape, quant, "random", torch.bfloat16, 70, device=device)
    got = fused_moe_int(*args, DECODE)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 5e-2 * want.float().abs().max()


@pytest.mark.parametrize("tokens,decode", [(1, True), (2, True), (3, False)])
def test_int_decode_takes_up_to_two_tokens(
    tokens: int, decode: bool, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default tiles: one and two tokens take the CUDA-core path, three the sorted grouped
    GEMM; a tensor-core config (BLOCK_M) keeps one token on the grouped GEMM."""
    calls = []
    decode_fn = fused_moe_module.moe_int_decode
    monkeypatch.setattr(
        fused_moe_module, "moe_int_decode", lambda *a, **k: calls.append(1) or decode_fn(*a, **k)
    )
    shape, quant = (tokens, 8, 3, 64, 64), (4, 32, False)
    args, want, _ = _int_case(shape, quant, "random", torch.float32, 80, device=device)
    got = fused_moe_int(*args)
    assert len(calls) == int(decode)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    if tokens == 1:
        fused_moe_int(*args, SMALL)
        assert len(calls) == 1


def test_int_decode_refuses_bad_tiles() -> None:
    args = _int_args()
    one = {
        **args,
        "x": args["x"][:1],
        "weights": args["weights"][:1],
        "experts": args["experts"][:1],
    }
    for config in ({**DECODE, "BLOCK_K": 48}, {**DECODE, "BLOCK_K": 16}, {**DECODE, "BLOCK_N": 24}):
        with pytest.raises(ValueError, match="BLOCK_K"):
            fused_moe_int(**one, config=config)
    assert decode_config_int(4)["BLOCK_K"] == 512 and "BLOCK_M" not in decode_config_int(8)


def _fp8_experts(experts, n, k, block, g):
    """Random weights [E, n, k] quantized to e4m3 with one scale per block (edge blocks part)."""
    bn, bk = block
    w = torch.randn(experts, n, k, generator=g) / k**0.5
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(experts, rows * bn, cols * bk)
    padded[:, :n, :k] = w
    blocks = padded.view(experts, rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-10) / FP8_MAX
    q = blocks / scale[:, :, None, :, None]
    return q.view(experts, rows * bn, cols * bk)[:, :n, :k].to(torch.float8_e4m3fn), scale


def _check_fp8(
    tokens, experts, top_k, hidden, inter, block, kind, dtype, device, seed, config, tol
):
    g = torch.Generator().manual_seed(seed)
    w13, s13 = _fp8_experts(experts, 2 * inter, hidden, block, g)
    w2, s2 = _fp8_experts(experts, hidden, inter, block, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, chosen = _route(kind, tokens, experts, top_k, g)
    args = [t.to(device) for t in (x, w13, s13, w2, s2, weights, chosen)]
    want = routed_experts_fp8_ref(*args, block)
    got = fused_moe_fp8(*args, block, config=config)
    assert got.shape == x.shape and got.dtype == dtype
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * want.abs().max().item(), err


@pytest.mark.parametrize("kind", ["random", "one-expert", "empty-experts"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 40])
def test_fused_moe_fp8_matches_the_per_expert_loop(tokens: int, kind: str, device: str) -> None:
    _check_fp8(tokens, 8, 3, 64, 32, (16, 32), kind, torch.float32, device, tokens, FP8_SMALL, 1e-5)


@pytest.mark.parametrize(
    "hidden,inter,block,config",
    [
        (40, 32, (16, 32), FP8_SMALL),  # H no block divides: partial blocks and K tiles
        (64, 48, (8, 32), FP8_SMALL),  # blocks narrower than the N tiles
        (256, 128, (128, 128), {**SMALL, "BLOCK_N": 32, "BLOCK_K": 128}),
    ],
    ids=["partial-blocks", "rect-blocks", "128x128"],
)
@pytest.mark.parametrize("tokens", [2, 5])
def test_fused_moe_fp8_block_shapes(
    hidden: int, inter: int, block: tuple[int, int], config, tokens: int, device: str
) -> None:
    _check_fp8(tokens, 4, 2, hidden, inter, block, "random", torch.float32, device, 9, config, 1e-5)


@pytest.mark.parametrize(
    "config",
    [{**FP8_SMALL, "QUANT_A": 1}, {**FP8_SMALL, "BLOCK_M": 64, "QUANT_A": 1}, FP8_SMALL],
    ids=["16-rows-in-loop", "64-rows-in-loop", "before-by-default"],
)
@pytest.mark.parametrize("tokens", [2, 40])
def test_fused_moe_fp8_activations_quantized_in_the_loop_or_before(
    config: dict, tokens: int, device: str
) -> None:
    """QUANT_A 1: each K tile's rows quantized in the GEMM's loop; 0 (the default): x and h
    quantized by fp8_gemm's launch, the GEMMs read e4m3 activations and their scales."""
    _check_fp8(tokens, 8, 3, 64, 32, (16, 32), "random", torch.float32, device, 11, config, 1e-5)


@pytest.mark.parametrize(
    "hidden,inter,block,quant_a",
    [(64, 32, (16, 32), 1), (40, 32, (16, 32), 1), (64, 48, (8, 32), 0)],
    ids=["in-loop", "partial-blocks", "rect-blocks-quantized-before"],
)
@pytest.mark.parametrize("kind", ["random", "one-expert"])
@pytest.mark.parametrize("tokens", [2, 40])
def test_fused_moe_fp8_swapped_dots(
    hidden: int, inter: int, block, quant_a: int, kind: str, tokens: int, device: str
) -> None:
    """SWAP_AB 1: each dot is W x^T (the few rows an expert as the MMA's narrow side), the same
    sums as x W^T."""
    config = {**FP8_SMALL, "SWAP_AB": 1, "QUANT_A": quant_a}
    _check_fp8(tokens, 8, 3, hidden, inter, block, kind, torch.float32, device, 21, config, 1e-5)


def test_fused_moe_fp8_gate_up_scales_one_a_row(device: str) -> None:
    """I (24) not a multiple of the block rows (16): gate and up quantized apart, in their own
    blocks, and w13's scales given one a row (each row its block's)."""
    g = torch.Generator().manual_seed(13)
    experts, hidden, inter, block, tokens = 4, 64, 24, (16, 32), 5
    gate, s_gate = _fp8_experts(experts, inter, hidden, block, g)
    up, s_up = _fp8_experts(experts, inter, hidden, block, g)
    w2, s2 = _fp8_experts(experts, hidden, inter, block, g)

    def per_row(scale: torch.Tensor, rows: int) -> torch.Tensor:
        return scale.repeat_interleave(block[0], 1)[:, :rows]

    w13 = torch.cat([gate, up], 1)
    s13 = torch.cat([per_row(s_gate, inter), per_row(s_up, inter)], 1)
    x = torch.randn(tokens, hidden, generator=g)
    weights, chosen = _route("random", tokens, experts, 2, g)
    # The reference reads every scale one a row (block (1, 32)): the same weights.
    want = routed_experts_fp8_ref(
        x, w13, s13, w2, per_row(s2, hidden), weights, chosen, (1, block[1])
    )
    args = [t.to(device) for t in (x, w13, s13, w2, s2, weights, chosen)]
    got = fused_moe_fp8(*args, block, config=FP8_SMALL).cpu()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_fused_moe_fp8_default_tiles(device: str) -> None:
    """The tiles fused_moe_fp8 picks itself (BLOCK_N past 2I and H, masked)."""
    _check_fp8(5, 4, 2, 48, 32, (16, 32), "random", torch.float32, device, 10, None, 1e-5)


FP8_DECODE = {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "down": {"BLOCK_N": 8}}
"""Small tiles of the FP8 CUDA-core decode path (no BLOCK_M: one and two tokens take it)."""


@pytest.mark.parametrize("kind", ["random", "one-expert", "empty-experts"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_fp8_decode_matches_the_per_expert_loop(tokens: int, kind: str, device: str) -> None:
    """W8A8 on the CUDA cores, a pair a program: the reference's products (x and h quantized per
    group, e4m3 times e4m3 exact in fp32), summed in another order."""
    _check_fp8(tokens, 8, 3, 64, 32, (16, 32), kind, torch.float32, device, 20 + tokens,
               FP8_DECODE, 1e-5)  # fmt: skip


@pytest.mark.parametrize(
    "hidden,inter,block,config",
    [
        (40, 32, (16, 32), FP8_DECODE),  # H no block or step divides: masked chunks
        (64, 48, (8, 32), FP8_DECODE),  # blocks narrower than a program's rows
        (256, 128, (128, 128), {**FP8_DECODE, "BLOCK_K": 64}),  # a block spans steps
        (64, 32, (16, 64), FP8_DECODE),  # one block along K: the scales applied once
        (256, 128, (128, 128), None),  # decode_config_fp8's tiles
    ],
    ids=["partial-blocks", "rect-blocks", "128x128", "one-block", "default-tiles"],
)
@pytest.mark.parametrize("tokens", [1, 2])
def test_fp8_decode_block_shapes(
    hidden: int, inter: int, block: tuple[int, int], config, tokens: int, device: str
) -> None:
    _check_fp8(tokens, 4, 2, hidden, inter, block, "random", torch.float32, device, 30, config,
               1e-5)  # fmt: skip


@pytest.mark.parametrize("target", [0, 1, 1000], ids=["whole-k", "split", "a-split-a-step"])
def test_fp8_decode_splits_k(target: int, device: str) -> None:
    """SPLIT_TARGET splits K (gate/up then adds its splits in a launch of its own)."""
    config = {"BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "SPLIT_TARGET": target}
    _check_fp8(2, 4, 2, 256, 128, (128, 128), "random", torch.float32, device, 31, config, 1e-5)


def test_fp8_decode_in_bf16_agrees_with_the_tensor_cores(device: str) -> None:
    """bf16 x: the decode path and the grouped GEMM round the same exact products' fp32 sums
    (in another order) to bf16 at the same points: within a unit in bf16's last place."""
    g = torch.Generator().manual_seed(32)
    block = (128, 128)
    w13, s13 = _fp8_experts(8, 256, 256, block, g)
    w2, s2 = _fp8_experts(8, 256, 128, block, g)
    x = torch.randn(2, 256, generator=g).bfloat16()
    weights, chosen = _route("random", 2, 8, 3, g)
    args = [t.to(device) for t in (x, w13, s13, w2, s2, weights, chosen)]
    cores = fused_moe_fp8(*args, block, config=FP8_DECODE).double()
    tiles = fused_moe_fp8(*args, block, config={**FP8_SMALL, "BLOCK_K": 128}).double()
    assert (cores - tiles).abs().max().item() <= 2.0**-7 * tiles.abs().max().item()


def test_fp8_decode_gate_up_scales_one_a_row(device: str) -> None:
    """w13's scales one a row (I not a multiple of the block rows) on the decode path."""
    g = torch.Generator().manual_seed(33)
    experts, hidden, inter, block = 4, 64, 24, (16, 32)
    gate, s_gate = _fp8_experts(experts, inter, hidden, block, g)
    up, s_up = _fp8_experts(experts, inter, hidden, block, g)
    w2, s2 = _fp8_experts(experts, hidden, inter, block, g)

    def per_row(scale: torch.Tensor, rows: int) -> torch.Tensor:
        return scale.repeat_interleave(block[0], 1)[:, :rows]

    w13 = torch.cat([gate, up], 1)
    s13 = torch.cat([per_row(s_gate, inter), per_row(s_up, inter)], 1)
    x = torch.randn(2, hidden, generator=g)
    weights, chosen = _route("random", 2, experts, 2, g)
    want = routed_experts_fp8_ref(
        x, w13, s13, w2, per_row(s2, hidden), weights, chosen, (1, block[1])
    )
    args = [t.to(device) for t in (x, w13, s13, w2, s2, weights, chosen)]
    got = fused_moe_fp8(*args, block, config=FP8_DECODE).cpu()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("tokens,decode", [(1, True), (2, True), (3, False)])
def test_fp8_decode_takes_up_to_two_tokens(
    tokens: int, decode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = fused_moe_module.moe_fp8_decode
    monkeypatch.setattr(
        fused_moe_module, "moe_fp8_decode", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    _check_fp8(tokens, 4, 2, 64, 32, (16, 32), "random", torch.float32, "cpu", 34, None, 1e-5)
    assert bool(calls) == decode
    calls.clear()  # a config with BLOCK_M keeps the tensor cores
    _check_fp8(tokens, 4, 2, 64, 32, (16, 32), "random", torch.float32, "cpu", 34, FP8_SMALL,
               1e-5)  # fmt: skip
    assert not calls


def test_fp8_decode_refuses_bad_tiles() -> None:
    g = torch.Generator().manual_seed(35)
    w13, s13 = _fp8_experts(4, 64, 64, (16, 32), g)
    w2, s2 = _fp8_experts(4, 64, 32, (16, 32), g)
    weights, chosen = _route("random", 1, 4, 2, g)
    for bad in ({"BLOCK_N": 3}, {"BLOCK_K": 24}, {"BLOCK_K": 8}):
        with pytest.raises(ValueError, match="fused_moe_fp8: BLOCK_K"):
            fused_moe_fp8(torch.zeros(1, 64), w13, s13, w2, s2, weights, chosen, (16, 32),
                          config={**FP8_DECODE, **bad})  # fmt: skip


def _int_args(hidden=64, inter=32, group=32, bits=4, experts=4):
    def packed(n, k):
        return torch.zeros(experts, n, -(-k * bits // 32), dtype=torch.int32)

    def scale(n, k):
        return torch.ones(experts, n, k // (group if group > 0 else k))

    return {
        "x": torch.zeros(3, hidden),
        "w13_packed": packed(2 * inter, hidden),
        "w13_scale": scale(2 * inter, hidden),
        "w13_zero": None,
        "w2_packed": packed(hidden, inter),
        "w2_scale": scale(hidden, inter),
        "w2_zero": None,
        "weights": torch.zeros(3, 2),
        "experts": torch.zeros(3, 2, dtype=torch.long),
        "bits": bits,
        "group_size": group,
    }


@pytest.mark.parametrize(
    "change,match",
    [
        ({"hidden": 48}, "H = 48 is not a multiple of the group"),
        ({"inter": 40}, "I = 40 is not a multiple of the group"),
        ({"group": 48, "hidden": 96, "inter": 48}, "power of two"),
        ({"bits": 3}, "3 bits"),
    ],
)
def test_fused_moe_int_refuses_shapes_that_do_not_fit(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fused_moe_int(**_int_args(**change))


def test_fused_moe_int_refuses_mismatched_tensors() -> None:
    args = _int_args()
    with pytest.raises(ValueError, match="w13_scale must be"):
        fused_moe_int(**{**args, "w13_scale": torch.ones(4, 64, 3)})
    with pytest.raises(ValueError, match="w2_zero must be"):
        fused_moe_int(**{**args, "w2_zero": torch.zeros(4, 64, 2, dtype=torch.int8)})
    with pytest.raises(ValueError, match="w2_packed must be int32"):
        fused_moe_int(**{**args, "w2_packed": args["w2_packed"].float()})
    with pytest.raises(ValueError, match="w2_packed"):
        fused_moe_int(**{**args, "w2_packed": torch.zeros(4, 32, 4, dtype=torch.int32)})
    with pytest.raises(ValueError, match="must both be"):
        fused_moe_int(**{**args, "experts": torch.zeros(2, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe_int(**args, config={**SMALL, "BLOCK_K": 24})


def _fp8_args(hidden=64, inter=32, block=(16, 32), experts=4):
    bn, bk = block

    def scale(n, k):
        return torch.ones(experts, -(-n // bn), -(-k // bk))

    return {
        "x": torch.zeros(3, hidden),
        "w13": torch.zeros(experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn),
        "w13_scale": scale(2 * inter, hidden),
        "w2": torch.zeros(experts, hidden, inter, dtype=torch.float8_e4m3fn),
        "w2_scale": scale(hidden, inter),
        "weights": torch.zeros(3, 2),
        "experts": torch.zeros(3, 2, dtype=torch.long),
        "block": block,
    }


def test_fused_moe_fp8_refuses_shapes_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="I = 24 is not a multiple of the block rows"):
        fused_moe_fp8(**_fp8_args(inter=24))
    for block in ((16, 24), (16, 16)):
        with pytest.raises(ValueError, match="a power of two >= 32"):
            fused_moe_fp8(**_fp8_args(block=block))
    args = _fp8_args()
    with pytest.raises(ValueError, match="w2_scale must be"):
        fused_moe_fp8(**{**args, "w2_scale": torch.ones(4, 4, 2)})
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_moe_fp8(**{**args, "w13": args["w13"].float()})
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe_fp8(**{**args, "x": torch.zeros(3, 48)})
    with pytest.raises(ValueError, match="BLOCK_K 64 must be the block's cols"):
        fused_moe_fp8(**args, config={**SMALL, "BLOCK_K": 64})


def test_quantized_tile_configs() -> None:
    assert tile_config_int(8, 64, 4)["BLOCK_M"] == 16
    assert tile_config_int(8192 * 8, 128, 4)["BLOCK_M"] == 128
    # INT4 pairs: 64-row wgmma tiles up to 64 rows an expert, deeper K from 12 on.
    assert [tile_config_int(p, 64, 4, pairs=True)["BLOCK_K"] for p in (96, 1536)] == [64, 128]
    assert tile_config_int(1536, 64, 4, pairs=True)["BLOCK_M"] == 64
    assert tile_config_int(6144, 64, 4, pairs=True)["BLOCK_M"] == 128
    for pairs in (9, 256 * 9, 8192 * 9):
        assert tile_config_fp8(pairs, 385, (128, 128))["BLOCK_K"] == 128
    # FP8: the few rows an expert as the dots' narrow side (W x^T) up to 64 rows an expert.
    assert [tile_config_fp8(p, 384, (128, 128)).get("SWAP_AB", 0) for p in (512, 8192, 65536)] == [
        1,
        1,
        0,
    ]


# Moonlight's routed experts (H 2048, I 1408, 64 experts top 6) plus its 2 shared ones.
MOONLIGHT = {"experts": 66, "hidden": 2048, "inter": 1408}


def _with_shared(chosen: torch.Tensor, weights: torch.Tensor, first_shared: int, shared: int):
    """Shared experts as always-chosen experts of weight 1 appended to every token's route."""
    t = chosen.shape[0]
    ids = torch.arange(first_shared, first_shared + shared).expand(t, shared)
    return torch.cat([chosen, ids], 1), torch.cat([weights, torch.ones(t, shared)], 1)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_fused_moe_int4_bf16_at_moonlights_dims(tokens: int) -> None:
    """W4A16, group 32 (Kimi K2.5's routed experts' format) at Moonlight's expert dims."""
    g = torch.Generator().manual_seed(11)
    dtype, hidden, inter, bits = torch.bfloat16, MOONLIGHT["hidden"], MOONLIGHT["inter"], 4
    p13, s13, _ = _int_experts(66, 2 * inter, hidden, bits, 32, False, dtype, g)
    p2, s2, _ = _int_experts(66, hidden, inter, bits, 32, False, dtype, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, chosen = _route("random", tokens, 64, 6, g)
    chosen, weights = _with_shared(chosen, weights, 64, 2)
    w13 = dequantize_int(p13, s13, None, bits, 32, hidden, dtype).cuda()
    w2 = dequantize_int(p2, s2, None, bits, 32, inter, dtype).cuda()
    want = routed_experts_ref(x.cuda(), w13, w2, weights.cuda(), chosen.cuda())
    on = [t.cuda() for t in (x, p13, s13)] + [None] + [t.cuda() for t in (p2, s2)] + [None]
    got = fused_moe_int(*on, weights.cuda(), chosen.cuda(), bits, 32)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * want.float().abs().max().item(), err


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_fused_moe_fp8_bf16_at_kimi_k2s_dims(tokens: int) -> None:
    """W8A8 with 128 x 128 blocks at Kimi K2's expert dims (H 7168, I 2048, top 8 + 1 shared),
    16 routed experts rather than 384 to keep the reference's loop short."""
    g = torch.Generator().manual_seed(12)
    block, hidden, inter = (128, 128), 7168, 2048
    w13, s13 = _fp8_experts(17, 2 * inter, hidden, block, g)
    w2, s2 = _fp8_experts(17, hidden, inter, block, g)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    weights, chosen = _route("random", tokens, 16, 8, g)
    chosen, weights = _with_shared(chosen, weights, 16, 1)
    cpu = [x, w13, s13, w2, s2, weights, chosen]
    # The reference on the CPU: torch on CUDA divides by 448 as a multiply by 1/448, which can
    # move an activation scale's last bit and flip a rare fp8 code (the H200 measured 2.1% of
    # the largest output against a GPU reference; fp8_gemm's tests met the same).
    want = routed_experts_fp8_ref(*cpu, block)
    got = fused_moe_fp8(*[t.cuda() for t in cpu], block).cpu()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * want.float().abs().max().item(), err


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int4", "fp8", "fp8-quantized-in-loop"])
def test_fused_moe_quant_is_captured_in_a_cuda_graph(kind: str) -> None:
    g = torch.Generator().manual_seed(13)
    experts, hidden, inter = 16, 256, 128
    if kind == "int4":
        p13, s13, z13 = _int_experts(experts, 2 * inter, hidden, 4, 32, True, torch.bfloat16, g)
        p2, s2, z2 = _int_experts(experts, hidden, inter, 4, 32, True, torch.bfloat16, g)
        tensors = [t.cuda() for t in (p13, s13, z13, p2, s2, z2)]

        def run(x, weights, chosen):
            return fused_moe_int(x, *tensors, weights, chosen, 4, 32)
    else:
        w13, s13 = _fp8_experts(experts, 2 * inter, hidden, (128, 128), g)
        w2, s2 = _fp8_experts(experts, hidden, inter, (128, 128), g)
        tensors = [t.cuda() for t in (w13, s13, w2, s2)]
        config = None
        if kind == "fp8-quantized-in-loop":  # activations quantized in the K loop
            config = {**tile_config_fp8(32, experts, (128, 128)), "QUANT_A": 1}

        def run(x, weights, chosen):
            return fused_moe_fp8(x, *tensors, weights, chosen, (128, 128), config=config)

    x = torch.randn(32, hidden, generator=g).cuda().bfloat16()
    weights = torch.rand(32, 2, generator=g).cuda()
    chosen = torch.randint(0, experts, (32, 2), generator=g).cuda()
    for t in (1, 32):  # unsorted (a block a pair) and sorted by expert
        run(x[:t], weights[:t], chosen[:t])  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x[:t], weights[:t], chosen[:t])
        chosen.copy_(torch.randint(0, experts, (32, 2), generator=g).cuda())
        x.copy_(torch.randn(32, hidden, generator=g).cuda().bfloat16())
        graph.replay()
        torch.testing.assert_close(out, run(x[:t], weights[:t], chosen[:t]))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2])
def test_int_decode_bf16_at_moonlights_dims(tokens: int) -> None:
    """INT4 in groups of 32, bf16, Moonlight's expert dims (16 experts, top 6), the default
    tiles: within 2e-2 of the reference, and no further from the float64 MLP than it."""
    shape, quant = (tokens, 16, 6, MOONLIGHT["hidden"], MOONLIGHT["inter"]), (4, 32, False)
    args, want, exact = _int_case(shape, quant, "random", torch.bfloat16, 90, device="cuda")
    got = fused_moe_int(*args)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
    assert _rel(got, exact) <= _rel(want, exact)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, {**DECODE, "SPLIT_TARGET": 64}], ids=["default", "split"])
def test_int_decode_is_captured_in_a_cuda_graph(config) -> None:
    """One and two tokens replayed from CUDA graphs on new routes and activations: the same bits
    as eager calls (with K split too: gate/up's sum launch, down's splits)."""
    g = torch.Generator().manual_seed(15)
    experts, hidden, inter = 16, 512, 384
    made = _int_experts(experts, 2 * inter, hidden, 4, 32, True, torch.bfloat16, g)
    made += _int_experts(experts, hidden, inter, 4, 32, True, torch.bfloat16, g)
    tensors = [t.cuda() for t in made]

    def run(x, weights, chosen):
        return fused_moe_int(x, *tensors, weights, chosen, 4, 32, config=config)

    x = torch.randn(2, hidden, generator=g).cuda().bfloat16()
    weights = torch.rand(2, 6, generator=g).cuda()
    chosen = torch.stack([torch.randperm(experts, generator=g)[:6] for _ in range(2)]).cuda()
    for t in (1, 2):
        run(x[:t], weights[:t], chosen[:t])  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x[:t], weights[:t], chosen[:t])
        chosen.copy_(torch.stack([torch.randperm(experts, generator=g)[:6] for _ in range(2)]))
        x.copy_(torch.randn(2, hidden, generator=g).bfloat16())
        graph.replay()
        torch.testing.assert_close(out, run(x[:t], weights[:t], chosen[:t]), rtol=0, atol=0)
