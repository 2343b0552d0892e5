"""Tiny compressed-tensors checkpoints quantized and compressed by compressed-tensors itself, and
their dequantized twins: the oracle ember's quantized-weights loading is checked against.

A checkpoint is written the model-free way (tensor by tensor, as llm-compressor's `model_free_ptq`
does): the scale and zero point of every targeted Linear weight come from compressed-tensors'
`calculate_qparams` over the weight's min/max per tensor, channel, group or block, the compressor
compressed-tensors registers for the scheme's format packs it, and compressed-tensors'
`convert_checkpoint` copies the other files and writes config.json's `quantization_config`. The
dequantized twin is compressed-tensors' own `CompressedTensorsDequantizer` run over that
checkpoint. Every quantized checkpoint is bfloat16, as published ones are: the unquantized
tensors and the scales in bfloat16 and `torch_dtype: bfloat16` in config.json.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
    CompressedTensorsDequantizer,
)
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    QuantizationType,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    maybe_pad_tensor_for_block_quant,
)
from compressed_tensors.utils.match import match_quantizable_tensors

from ember.models.tiny import make_tiny

DTYPE = torch.bfloat16

# Schemes beyond compressed-tensors' presets. CT 0.20's W8A16 preset is INT8 in groups of 128;
# the channel-wise INT8 of llm-compressor's published w8a16 checkpoints is spelled out here.
EXTRA_SCHEMES: dict[str, dict[str, QuantizationArgs]] = {
    "W8A16_CHANNEL": {
        "weights": QuantizationArgs(
            num_bits=8,
            type=QuantizationType.INT,
            strategy=QuantizationStrategy.CHANNEL,
            symmetric=True,
            dynamic=False,
        )
    },
    # FP8 weights with one scale per tensor, FP8 activations quantized per token at run time.
    "FP8_TENSOR_DYNAMIC": {
        "weights": QuantizationArgs(
            num_bits=8,
            type=QuantizationType.FLOAT,
            strategy=QuantizationStrategy.TENSOR,
            symmetric=True,
            dynamic=False,
        ),
        "input_activations": QuantizationArgs(
            num_bits=8,
            type=QuantizationType.FLOAT,
            strategy=QuantizationStrategy.TOKEN,
            symmetric=True,
            dynamic=True,
        ),
    },
}

# Kimi K2.5's published ignore list (its text model's entries; the vision tower's are left out,
# as the tiny has none): INT4 on the routed experts only. The router gate needs no entry: it is
# no Linear in the model's code, so the "Linear" target never reaches it.
KIMI_IGNORE = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
]
# llm-compressor's Qwen3 MoE recipe: the router (`mlp.gate`, a Linear in the model's code) stays
# unquantized; here attention too, so only the experts are.
QWEN3_MOE_IGNORE = ["lm_head", "re:.*self_attn.*", r"re:.*mlp\.gate$"]

# Checkpoint tensors never quantized here: the embedding, no Linear in any model's code, and the
# MoE router, none in DeepSeek-V3's. A model-free pass sees only names, so it is told (and so is
# the dequantizer, for formats that keep the name `weight`); none of this goes into config.json.
NOT_LINEAR = [r"re:.*embed_tokens$", r"re:.*mlp\.gate$"]
# compressed-tensors' dequantizer asks every `weight` of a "Linear"-targeted float checkpoint for
# its scale, the norms' too (it skips norms when it dequantizes, not when it gathers): told here.
DEQUANTIZER_IGNORE = [*NOT_LINEAR, r"re:.*norm$"]

# Every Linear's rows and columns a multiple of 128, for groups and blocks of 128. The tiny llama's
# MLP is 128 wide whatever the config says (make_tiny draws it from a constant), so it stays 128.
SIZES_128 = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


@dataclass(frozen=True, slots=True)
class QuantCase:
    """A tiny checkpoint to quantize: its arch, config overrides and quantization."""

    arch: str
    scheme: str
    ignore: list[str]
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    group_size: int | None = None
    symmetric: bool | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


CASES: dict[str, QuantCase] = {
    "llama_w4a16_g32": QuantCase("llama", "W4A16", ["lm_head"], group_size=32),
    "llama_w4a16_asym_g128": QuantCase("llama", "W4A16_ASYM", ["lm_head"], overrides=SIZES_128),
    "llama_w8a16_channel": QuantCase("llama", "W8A16_CHANNEL", ["lm_head"]),
    "llama_fp8_dynamic": QuantCase("llama", "FP8_DYNAMIC", ["lm_head"]),
    "llama_fp8_tensor": QuantCase("llama", "FP8_TENSOR_DYNAMIC", ["lm_head"]),
    "llama_fp8_block": QuantCase("llama", "FP8_BLOCK", ["lm_head"], overrides=SIZES_128),
    "qwen3_moe_w4a16_experts": QuantCase("qwen3_moe", "W4A16", QWEN3_MOE_IGNORE, group_size=32),
    "kimi_k2_int4": QuantCase("kimi_k2", "W4A16", KIMI_IGNORE, group_size=32),
    "deepseek_v3_int4": QuantCase("deepseek_v3", "W4A16", KIMI_IGNORE, group_size=32),
}


def quantization_scheme(
    scheme: str,
    targets: list[str],
    *,
    group_size: int | None = None,
    symmetric: bool | None = None,
) -> QuantizationScheme:
    """compressed-tensors' preset `scheme` (or one of EXTRA_SCHEMES) for `targets`, with its weights'
    group size and symmetry replaced where given, and its format set as compressed-tensors infers
    it for a Linear."""
    if scheme.upper() in PRESET_SCHEMES:
        quant = preset_name_to_scheme(scheme, targets)
    elif scheme in EXTRA_SCHEMES:
        quant = QuantizationScheme(targets=targets, **copy.deepcopy(EXTRA_SCHEMES[scheme]))
    else:
        known = ", ".join([*PRESET_SCHEMES, *EXTRA_SCHEMES])
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {known}")
    weights = quant.weights.model_dump()
    if group_size is not None:
        weights.update(strategy=QuantizationStrategy.GROUP.value, group_size=group_size)
    if symmetric is not None:
        weights["symmetric"] = symmetric
    # Validated anew, so that fields derived from others (the zero point's dtype) follow them.
    quant.weights = QuantizationArgs.model_validate(weights)
    quant.format = infer_module_format(torch.nn.Linear, quant)
    return quant


def weight_qparams(
    weight: torch.Tensor, args: QuantizationArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scale, zero point) compressed-tensors computes from `weight`'s min and max, per
    tensor, output channel, group of columns or block; the scale in the weight's dtype."""
    if args.strategy == QuantizationStrategy.TENSOR:
        lo, hi = weight.amin(), weight.amax()
    elif args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
    elif args.strategy == QuantizationStrategy.GROUP:
        groups = weight.unflatten(-1, (-1, args.group_size))
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    elif args.strategy == QuantizationStrategy.BLOCK:
        rows, cols = args.block_structure
        # Zero padding moves no block's range: calculate_qparams puts 0 in every range anyway.
        padded = maybe_pad_tensor_for_block_quant(weight, (rows, cols))
        blocks = padded.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
        lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    else:
        raise ValueError(f"no weight qparams for strategy {args.strategy!r}")
    scale, zero_point = calculate_qparams(lo, hi, args)
    # The module's scale parameter has the weight's dtype; llm-compressor copies into it.
    return scale.to(weight.dtype), zero_point


class _Quantize:
    """A compressed-tensors `Converter` that quantizes and compresses a plain checkpoint's Linear
    weights by `config` and casts every other floating tensor to DTYPE."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = dict(tensors)
        out: dict[str, torch.Tensor] = {}
        ignore = [*self.config.ignore, *NOT_LINEAR]
        for scheme in self.config.config_groups.values():
            compressor = BaseCompressor.get_value_from_registry(scheme.format)
            matched = list(match_quantizable_tensors(tensors, ignore, scheme.targets))
            for module, name in matched:
                weight = tensors.pop(name).to(DTYPE)
                scale, zero_point = weight_qparams(weight, scheme.weights)
                state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
                for key, value in compressor.compress(state, scheme).items():
                    out[f"{module}.{key}"] = value
        for name, tensor in tensors.items():
            out[name] = tensor.to(DTYPE) if tensor.is_floating_point() else tensor
        return out

    def validate(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.process(tensors)

    def update_config(self, config: QuantizationConfig | None) -> QuantizationConfig:
        return self.config

    def update_model_config(self, model_config: dict[str, Any]) -> dict[str, Any]:
        return model_config | {"torch_dtype": "bfloat16"}

    def get_dependencies(self, weight_name: str) -> set[str]:
        return set()


def quantization_config(
    scheme: str,
    *,
    ignore: list[str] | None = None,
    targets: list[str] | None = None,
    group_size: int | None = None,
    symmetric: bool | None = None,
) -> QuantizationConfig:
    """The compressed-tensors config of one scheme group, in its compressed state."""
    quant = quantization_scheme(
        scheme, targets or ["Linear"], group_size=group_size, symmetric=symmetric
    )
    return QuantizationConfig(
        config_groups={"group_0": quant},
        format=quant.format,
        ignore=list(ignore or []),
        quantization_status=QuantizationStatus.COMPRESSED,
    )


def write_quantized(
    src: Path,
    dst: Path,
    scheme: str,
    *,
    ignore: list[str] | None = None,
    targets: list[str] | None = None,
    group_size: int | None = None,
    symmetric: bool | None = None,
) -> Path:
    """Write `src` (a plain checkpoint) into `dst` with its Linear weights quantized by `scheme`
    (a compressed-tensors preset or one of EXTRA_SCHEMES) and compressed by compressed-tensors;
    `ignore` and `targets` are compressed-tensors' module patterns. Returns `dst`."""
    config = quantization_config(
        scheme, ignore=ignore, targets=targets, group_size=group_size, symmetric=symmetric
    )
    _fresh(dst)
    convert_checkpoint(src, dst, _Quantize(config), max_workers=1, device="cpu")
    return dst


def write_dequantized(src: Path, dst: Path) -> Path:
    """Write the quantized checkpoint `src` into `dst` as a plain bfloat16 checkpoint of the
    weights compressed-tensors decompresses, with no quantization_config. Returns `dst`."""
    _fresh(dst)
    dequantizer = CompressedTensorsDequantizer(src, ignore=DEQUANTIZER_IGNORE, dtype=DTYPE)
    convert_checkpoint(src, dst, dequantizer, max_workers=1, device="cpu")
    return dst


def make_quantized(out_dir: Path, case: str, *, seed: int = 0) -> tuple[Path, Path, Path]:
    """Make CASES[`case`]'s tiny checkpoint under `out_dir` and return the paths of the original,
    the quantized and the dequantized checkpoints."""
    spec = CASES[case]
    out = Path(out_dir)
    src = make_tiny(out / "original", spec.arch, seed=seed, overrides=spec.overrides)
    quantized = write_quantized(
        src,
        out / "quantized",
        spec.scheme,
        ignore=spec.ignore,
        targets=spec.targets,
        group_size=spec.group_size,
        symmetric=spec.symmetric,
    )
    return src, quantized, write_dequantized(quantized, out / "dequantized")


def _fresh(path: Path) -> None:
    # A file left from an earlier write would be copied along or shadow the new weights.
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
