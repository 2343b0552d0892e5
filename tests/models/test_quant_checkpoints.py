"""The compressed-tensors checkpoints of quant_checkpoints.py: each holds the tensors and config
compressed-tensors publishes, its decompressed weights sit within the scheme's quantization error
of the original's, and transformers loads it into the model of its dequantized twin.

transformers loads a compressed-tensors checkpoint two ways. With `dequantize=True` it decompresses
every weight at load (compressed-tensors' own decompressor) into a plain model: that model equals
the dequantized twin's exactly, for every scheme. By default it keeps the Linear modules quantized,
decompresses their weights on the first forward, and from then on fake-quantizes the inputs of
modules whose scheme quantizes activations (FP8 per token or per group of 128 here): those logits
move off the twin's by the activations' FP8 rounding, and equal them once that is switched off.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationStrategy,
    disable_quantization,
)
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    CompressedTensorsConfig,
    DeepseekV3Config,
    PreTrainedModel,
)

from tests.models.hf_reference import hf_greedy, hf_logits
from tests.models.quant_checkpoints import (
    CASES,
    DTYPE,
    KIMI_IGNORE,
    make_quantized,
    quantization_config,
)
from tests.models.test_vs_transformers import random_prompt

Checkpoints = tuple[Path, Path, Path]

# The modules each case quantizes, named independently of compressed-tensors' matching.
_EVERY_PROJ = r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"
_ROUTED_EXPERTS = r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj"
QUANTIZED = {
    "llama_w4a16_g32": _EVERY_PROJ,
    "llama_w4a16_asym_g128": _EVERY_PROJ,
    "llama_w8a16_channel": _EVERY_PROJ,
    "llama_fp8_dynamic": _EVERY_PROJ,
    "llama_fp8_tensor": _EVERY_PROJ,
    "llama_fp8_block": _EVERY_PROJ,
    "qwen3_moe_w4a16_experts": _ROUTED_EXPERTS,
    "kimi_k2_int4": _ROUTED_EXPERTS,
    "deepseek_v3_int4": _ROUTED_EXPERTS,
}
# Kimi K2.5's scheme as compressed-tensors 0.20 writes it (the published config.json, written by
# an older version, adds the weights' defaults: observer "minmax", actorder and block_structure
# null).
KIMI_QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": "pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "global_compression_ratio": None,
    "ignore": KIMI_IGNORE,
    "kv_cache_scheme": None,
    "moe_sparsity_config": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
PROMPTS = 3
PROMPT_LEN = 8
NEW_TOKENS = 6
# FP8 activations (e4m3: 3 mantissa bits, a rounding of up to 2^-4 relative per element) move the
# tiny llama's logits 0.050 to 0.067 of their norm here (per token, per tensor and per group of 128
# alike); FP8 weights move them 0.100 (test_fp8_loading.py).
FP8_ACTIVATION_LOGIT_RTOL = 0.1


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoints]:
    """`made(case)` -> (original, quantized, dequantized) checkpoint dirs, made once."""
    cache: dict[str, Checkpoints] = {}

    def get(case: str) -> Checkpoints:
        if case not in cache:
            cache[case] = make_quantized(tmp_path_factory.mktemp(case), case)
        return cache[case]

    return get


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def weight_args(case: str) -> QuantizationArgs:
    spec = CASES[case]
    config = quantization_config(spec.scheme, group_size=spec.group_size, symmetric=spec.symmetric)
    return config.config_groups["group_0"].weights


def per_element(scale: torch.Tensor, shape: torch.Size, args: QuantizationArgs) -> torch.Tensor:
    """`scale` spread over a weight of `shape`: one value per tensor, row, group or block."""
    rows, cols = shape
    if args.strategy == QuantizationStrategy.TENSOR:
        return scale.reshape(1, 1).expand(rows, cols)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return scale.reshape(rows, 1).expand(rows, cols)
    if args.strategy == QuantizationStrategy.GROUP:
        return scale.repeat_interleave(args.group_size, dim=1)
    block_rows, block_cols = args.block_structure
    spread = scale.repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)
    return spread[:rows, :cols]


def unpack(packed: torch.Tensor, bits: int, count: int, dim: int = 1) -> torch.Tensor:
    """Signed `bits`-bit integers packed into int32 words along `dim`, lowest bits first and
    offset by 2^(bits - 1): the pack-quantized layout, read without compressed-tensors."""
    if dim == 0:
        return unpack(packed.T, bits, count).T
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)[..., :count] - (1 << (bits - 1))


def quantized_modules(case: str, original: dict[str, torch.Tensor]) -> list[str]:
    pattern = re.compile(QUANTIZED[case])
    names = [n.removesuffix(".weight") for n in original if n.endswith(".weight")]
    return [n for n in names if pattern.fullmatch(n)]


def load_hf(path: Path, **kwargs: object) -> PreTrainedModel:
    """transformers' model of `path`, in bfloat16, with no missing or unexpected weight."""
    raw = json.loads((path / "config.json").read_text())
    if raw["model_type"] == "kimi_k2":
        # transformers knows no kimi_k2; its DeepseekV3 classes read the same fields.
        kwargs["config"] = DeepseekV3Config.from_dict({**raw, "model_type": "deepseek_v3"})
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPE, output_loading_info=True, **kwargs
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def prompts(model: PreTrainedModel) -> list[list[int]]:
    return [random_prompt(seed, PROMPT_LEN, model.config.vocab_size) for seed in range(PROMPTS)]


@pytest.mark.parametrize("case", CASES)
def test_config_is_compressed_tensors(case: str, made: Callable[[str], Checkpoints]) -> None:
    original, quantized, dequantized = made(case)
    spec = CASES[case]
    config = json.loads((quantized / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["quantization_status"] == "compressed"
    assert qc["ignore"] == spec.ignore
    fmt = "float-quantized" if spec.scheme.startswith("FP8") else "pack-quantized"
    assert qc["format"] == qc["config_groups"]["group_0"]["format"] == fmt
    assert config["torch_dtype"] == "bfloat16"
    # What transformers and vLLM parse is what compressed-tensors wrote.
    parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "version"})
    assert (
        parsed.config_groups
        == quantization_config(
            spec.scheme, ignore=spec.ignore, group_size=spec.group_size, symmetric=spec.symmetric
        ).config_groups
    )
    plain = json.loads((dequantized / "config.json").read_text())
    assert "quantization_config" not in plain
    assert {k: v for k, v in config.items() if k != "quantization_config"} == plain
    if spec.arch == "kimi_k2":
        assert qc == KIMI_QUANTIZATION_CONFIG | {"version": qc["version"]}


@pytest.mark.parametrize("case", CASES)
def test_tensor_names_and_dtypes(case: str, made: Callable[[str], Checkpoints]) -> None:
    original_dir, quantized_dir, dequantized_dir = made(case)
    original, quantized = tensors(original_dir), tensors(quantized_dir)
    args = weight_args(case)
    modules = quantized_modules(case, original)
    assert modules, "the case quantizes nothing"
    names: set[str] = set()
    for module in modules:
        rows, cols = original[f"{module}.weight"].shape
        scale = quantized[f"{module}.weight_scale"]
        assert scale.dtype == DTYPE
        assert per_element(scale, torch.Size((rows, cols)), args).shape == (rows, cols)
        if args.type == "float":
            assert quantized[f"{module}.weight"].dtype == torch.float8_e4m3fn
            assert quantized[f"{module}.weight"].shape == (rows, cols)
            names |= {f"{module}.weight", f"{module}.weight_scale"}
            continue
        packed = quantized[f"{module}.weight_packed"]
        assert packed.dtype == torch.int32 and packed.shape == (rows, cols * args.num_bits // 32)
        shape = quantized[f"{module}.weight_shape"]
        assert shape.dtype == torch.int64 and shape.tolist() == [rows, cols]
        names |= {f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape"}
        if not args.symmetric:
            zero_point = quantized[f"{module}.weight_zero_point"]
            # Packed along the rows, as the scales' columns are groups.
            assert zero_point.dtype == torch.int32
            assert zero_point.shape == (rows * args.num_bits // 32, scale.shape[1])
            names.add(f"{module}.weight_zero_point")
    # Every other tensor is the original's, in bfloat16, under its own name.
    kept = {n for n in original if n.removesuffix(".weight") not in modules}
    assert set(quantized) == names | kept
    assert all(quantized[n].dtype == DTYPE for n in kept)
    assert set(tensors(dequantized_dir)) == set(original)


@pytest.mark.parametrize("case", CASES)
def test_decompressed_within_quantization_error(
    case: str, made: Callable[[str], Checkpoints]
) -> None:
    original_dir, quantized_dir, dequantized_dir = made(case)
    original, quantized = tensors(original_dir), tensors(quantized_dir)
    dequantized = tensors(dequantized_dir)
    args = weight_args(case)
    for module in quantized_modules(case, original):
        w = original[f"{module}.weight"].to(DTYPE).float()
        got = dequantized[f"{module}.weight"]
        assert got.dtype == DTYPE
        got = got.float()
        scale = per_element(quantized[f"{module}.weight_scale"].float(), w.shape, args)
        if args.type == "float":
            codes = quantized[f"{module}.weight"].float()
            # e4m3 rounds to 3 mantissa bits (half an ulp: 2^-4 relative) and its subnormals are
            # 2^-9 apart; the product is rounded to bfloat16 (2^-8 relative).
            bound = 2**-4 * w.abs() + 2**-10 * scale + 2**-8 * got.abs()
        else:
            codes = unpack(quantized[f"{module}.weight_packed"], args.num_bits, w.shape[1])
            if not args.symmetric:
                zp = unpack(quantized[f"{module}.weight_zero_point"], args.num_bits, w.shape[0], 0)
                codes = codes - per_element(zp.float(), w.shape, args)
            assert codes.abs().max() <= 2**args.num_bits
            # Half a step; plus what the bfloat16 arithmetic of the qparams (as llm-compressor
            # does it, in the weight's dtype) moves codes up to 2^bits steps from zero: 2^-8 of
            # them for each rounding, one for the scale, three with a zero point; plus the
            # product's bfloat16 rounding.
            roundings = 1 if args.symmetric else 3
            slack = roundings * 2**args.num_bits * 2**-8
            bound = (0.5 + slack) * scale + 2**-8 * got.abs()
        # CT's decompression is the codes times the scale (less the zero point), in bfloat16.
        assert torch.equal(got, (codes * scale).to(DTYPE).float()), module
        err = (got - w).abs()
        assert (err <= bound).all(), f"{module}: {(err - bound).max().item():.3g} past the bound"
        # And the weight was quantized, not copied.
        assert err.max() > 0


# transformers warns that the checkpoint's own quantization_config wins, all but `dequantize`.
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("case", CASES)
def test_transformers_dequantized_load(case: str, made: Callable[[str], Checkpoints]) -> None:
    _, quantized, dequantized = made(case)
    reference = load_hf(dequantized)
    model = load_hf(quantized, quantization_config=CompressedTensorsConfig(dequantize=True))
    want = reference.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    for prompt in prompts(reference):
        assert hf_greedy(model, prompt, NEW_TOKENS) == hf_greedy(reference, prompt, NEW_TOKENS)
        assert torch.equal(hf_logits(model, prompt), hf_logits(reference, prompt))


@pytest.mark.parametrize("case", CASES)
def test_transformers_compressed_load(case: str, made: Callable[[str], Checkpoints]) -> None:
    original, quantized, dequantized = made(case)
    spec = CASES[case]
    if not weight_args(case).symmetric:
        pytest.xfail(
            "transformers makes the compressed modules with compressed-tensors 0.20's "
            "PackedQuantizationCompressor.compress on meta weights, which leaves the zero point "
            "unpacked ([rows, groups]) while the checkpoint's is packed ([rows / 8, groups]): "
            "the load refuses the size mismatch. dequantize=True loads it."
        )
    reference = load_hf(dequantized)
    model = load_hf(quantized)
    # The Linear modules stay quantized; the fused MoE experts (no Linear modules in transformers)
    # are decompressed as they load, whatever `dequantize` says.
    held = {n for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    linear = set(quantized_modules(case, tensors(original)))
    assert held == (set() if QUANTIZED[case] == _ROUTED_EXPERTS else linear)
    acts = quantization_config(spec.scheme).config_groups["group_0"].input_activations
    for prompt in prompts(reference):
        want = hf_logits(reference, prompt)
        got = hf_logits(model, prompt)
        if acts is None:
            assert torch.equal(got, want)
            assert hf_greedy(model, prompt, NEW_TOKENS) == hf_greedy(reference, prompt, NEW_TOKENS)
        else:
            # The activations are fake-quantized to FP8: near the twin's logits, not on them.
            assert not torch.equal(got, want)
            assert (got - want).norm() / want.norm() < FP8_ACTIVATION_LOGIT_RTOL
    if acts is not None:
        model.apply(disable_quantization)
        for prompt in prompts(reference):
            assert torch.equal(hf_logits(model, prompt), hf_logits(reference, prompt))
            assert hf_greedy(model, prompt, NEW_TOKENS) == hf_greedy(reference, prompt, NEW_TOKENS)
