"""Malformed quantized checkpoints are refused at load, naming the weight and what is wrong: a
missing packed weight, scale or zero point, a tensor of the wrong dtype or shape, a weight_shape
that is not the layer's, a group size that does not divide a layer's inputs, quantized tensors
where the config quantizes nothing, a plain weight where it quantizes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.models.loader import load_model
from tests.models.quant_checkpoints import make_quantized

Q = "model.layers.1.self_attn.o_proj"
E = "model.layers.1.mlp.experts.3.up_proj"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("malformed")
    return {
        case: make_quantized(root / case, case, seed=3)[1]
        for case in ("llama_w4a16_asym_g128", "qwen3_moe_w4a16_experts", "llama_fp8_block")
    }


def edited(
    src: Path,
    dst: Path,
    edit: Callable[[dict[str, torch.Tensor]], None],
    config: Callable[[dict], None] | None = None,
) -> Path:
    """A copy of checkpoint `src` with its tensors (one dict over every shard) edited."""
    shutil.copytree(src, dst)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(dst.glob("*.safetensors")):
        tensors |= load_file(str(f))
        f.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def drop(name: str) -> Callable[[dict], None]:
    return lambda t: t.pop(name)


def replace(name: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[name] = value(t[name])

    return edit


CASES = [
    (
        "llama_w4a16_asym_g128",
        drop(f"{Q}.weight_scale"),
        rf"lacks weights: \['{Q}\.weight_scale'\]",
    ),
    (
        "llama_w4a16_asym_g128",
        drop(f"{Q}.weight_zero_point"),
        rf"lacks weights: \['{Q}\.weight_zero_point'\]",
    ),
    (
        "llama_w4a16_asym_g128",
        drop(f"{Q}.weight_packed"),
        rf"lacks weights: \['{Q}\.weight_packed'\]",
    ),
    (
        "llama_w4a16_asym_g128",
        replace(f"{Q}.weight_packed", lambda t: t.to(torch.int64)),
        rf"{Q}\.weight_packed is torch\.int64, expected torch\.int32",
    ),
    (
        "llama_w4a16_asym_g128",
        replace(f"{Q}.weight_packed", lambda t: t[:, :-1].contiguous()),
        rf"{Q}\.weight_packed has shape \(256, 31\), expected \(256, 32\)",
    ),
    (
        "llama_w4a16_asym_g128",
        replace(f"{Q}.weight_scale", lambda t: t[:, :1].repeat(1, 3)),
        rf"{Q}\.weight_scale has shape \(256, 3\), expected \(256, 2\)",
    ),
    (
        "llama_w4a16_asym_g128",
        replace(f"{Q}.weight_zero_point", lambda t: t[:-1]),
        rf"{Q}\.weight_zero_point is torch\.int32 \(31, 2\), expected int32 \(32, 2\)",
    ),
    (
        "llama_w4a16_asym_g128",
        replace(f"{Q}.weight_shape", lambda t: t + 1),
        rf"{Q}\.weight_shape says \(257, 257\); the model's layer is \(256, 256\)",
    ),
    (
        "qwen3_moe_w4a16_experts",
        drop(f"{E}.weight_scale"),
        r"lacks parts of weights: .*model\.layers\.1\.mlp\.experts\.w13_scale \(3\.up\)",
    ),
    (
        "qwen3_moe_w4a16_experts",
        replace(f"{E}.weight_packed", lambda t: t.float()),
        rf"{E}\.weight_packed is torch\.float32, expected int32",
    ),
    (
        "llama_fp8_block",
        replace(f"{Q}.weight_scale", lambda t: t[:1]),
        rf"{Q}\.weight_scale has shape \(1, 2\); 256 x 256 in 128x128 blocks needs \(2, 2\)",
    ),
    (
        "llama_fp8_block",
        replace(f"{Q}.weight", lambda t: t.to(torch.bfloat16)),
        r"is torch\.bfloat16, expected torch\.float8_e4m3fn|is quantized .* not 'weight'",
    ),
    (
        "llama_fp8_block",
        lambda t: t.update({"model.layers.1.input_layernorm.weight_scale": torch.ones(1)}),
        r"checkpoint has weight 'model\.layers\.1\.input_layernorm\.weight_scale', which this "
        r"model does not",
    ),
    (
        "llama_fp8_block",
        lambda t: t.update({f"{Q}.input_scale": torch.ones(1)}),
        rf"{Q}\.input_scale': static activation scales are not supported",
    ),
]


@pytest.mark.parametrize(("case", "edit", "message"), CASES)
def test_malformed_tensors_are_refused_by_name(checkpoints, tmp_path, case, edit, message) -> None:
    path = edited(checkpoints[case], tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=message):
        load_model(path, dtype=torch.bfloat16)


def test_a_group_that_does_not_divide_a_layer_is_refused(checkpoints, tmp_path) -> None:
    def group_48(cfg: dict) -> None:
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 48

    path = edited(checkpoints["llama_w4a16_asym_g128"], tmp_path / "g48", lambda t: None, group_48)
    with pytest.raises(ValueError, match=r"qkv_proj: group size 48 does not divide its 256 inputs"):
        load_model(path, dtype=torch.bfloat16)


def test_quantized_tensors_without_a_config_are_refused(checkpoints, tmp_path) -> None:
    path = edited(
        checkpoints["llama_w4a16_asym_g128"],
        tmp_path / "no-config",
        lambda t: None,
        lambda cfg: cfg.pop("quantization_config"),
    )
    with pytest.raises(ValueError, match=r"weight_\w+' .* is quantized, but config\.json has no"):
        load_model(path, dtype=torch.bfloat16)
