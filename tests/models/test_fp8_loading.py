"""FP8 block-quantized DeepSeek-V3 checkpoints (float8_e4m3fn weights, a float32 weight_scale_inv
per block, as DeepSeek and Kimi publish them), kept in FP8 by the model. A tiny checkpoint is
quantized here block by block, with blocks that leave partial edge blocks, whole and with weights
and their scales in different shards in both orders: every quantized layer holds the checkpoint's
bits and scales, which dequantize to exactly the weights of a plain checkpoint of the dequantized
weights (MLA's kv_b_proj, which attention splits per head, is dequantized as it loads); ember's
logits sit within the activations' FP8 rounding of that plain checkpoint's and within fp8's error
of the original's; malformed checkpoints and configs are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember import LLM, SamplingParams
from ember.kernels.quant_ref import dequantize_fp8
from ember.models.checkpoint_files import safetensors_files
from ember.models.config import ModelConfig
from ember.models.layers.quant_linear import QuantLinear
from ember.models.layers.quant_moe import QuantFusedMoE
from ember.models.loader import load_model
from ember.models.quant_config import parse_quant_config
from ember.models.quant_weights import quantized_tensors
from ember.models.tiny import make_tiny
from ember.models.weight_staging import iter_safetensors
from tests.capture import captured_logits
from tests.models.test_vs_transformers import random_prompt

# 16 x 24 divides none of the tiny model's 40 rows (kv_a_proj_with_mqa) or its 64 and 32 columns;
# 128 x 128 is DeepSeek's and Kimi's block, one partial block for every tiny weight.
BLOCKS = {"16x24": (16, 24), "128x128": (128, 128)}
# Listed in modules_to_not_convert and stored unquantized, as such modules are.
NOT_CONVERTED = "model.layers.0.self_attn.o_proj"
E4M3_MAX = 448.0
# The dense variant's prefill logits from FP8 weights sat 0.100 (relative, Frobenius; max |diff|
# 0.88 on logits of std 2) from the original's with 16-bit activations: e4m3 keeps 3 mantissa
# bits, and the same weights rounded to bf16 (7 bits) move them 0.0055, 18x less. With the
# activations also in FP8 (per 24-element group, W8A8 as the checkpoint says) they sit 0.130.
FP8_LOGIT_RTOL = 0.15
# The activations' rounding alone (the same weights, dequantized, with 16-bit activations):
# 0.069 on the MoE model.
ACT_LOGIT_RTOL = 0.09


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` as float8_e4m3fn and its weight_scale_inv: each block scaled to fill e4m3's range."""
    rows, cols = block
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            part = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            scale = part.abs().max().clamp(min=1e-12) / E4M3_MAX
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = part / scale
            scale_inv[i, j] = scale
    return q, scale_inv


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: block by block, each fp8 block times its scale."""
    rows, cols = block
    w = q.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] *= scale_inv[i, j]
    return w


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek quantizes: every Linear but the router, lm_head and the listed modules."""
    kept = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", NOT_CONVERTED)
    return tensor.dim() == 2 and name.endswith(".weight") and not any(k in name for k in kept)


def write_checkpoint(src: Path, dst: Path, shards: list[dict[str, torch.Tensor]], qc=None) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model*.safetensors*"))
    if len(shards) == 1:
        save_file(shards[0], str(dst / "model.safetensors"))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(dst / filename))
            weight_map.update(dict.fromkeys(shard, filename))
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if qc is not None:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    return dst


def fp8_config(block: tuple[int, int]) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": [NOT_CONVERTED],
    }


def quantize_checkpoint(
    weights: dict[str, torch.Tensor], block: tuple[int, int]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what an FP8 checkpoint stores, the dequantized weights a plain checkpoint stores)."""
    stored, plain = {}, {}
    for name, w in weights.items():
        if quantized(name, w):
            q, scale_inv = quantize(w, block)
            stored[name], stored[name + "_scale_inv"] = q, scale_inv
            plain[name] = dequantize(q, scale_inv, block)
        else:
            stored[name] = plain[name] = w
    return stored, plain


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The original tiny model; per block size an FP8 checkpoint of it and a plain one of the
    dequantized weights; the 16x24 FP8 checkpoint in two shards; and a dense variant (no MoE
    layers, whose routing flips would swamp fp8's rounding) with its FP8 checkpoint."""
    root = tmp_path_factory.mktemp("fp8")
    original = make_tiny(root / "original", "deepseek_v3", seed=5)
    weights = load_file(str(original / "model.safetensors"))
    dirs = {"original": original}
    for label, block in BLOCKS.items():
        stored, plain = quantize_checkpoint(weights, block)
        qc = fp8_config(block)
        dirs[f"fp8-{label}"] = write_checkpoint(original, root / f"fp8-{label}", [stored], qc)
        dirs[f"plain-{label}"] = write_checkpoint(original, root / f"plain-{label}", [plain])
    # Shard 2 holds every other quantized weight and the scales of the rest: half the scales
    # arrive before their weights, half after.
    stored, _ = quantize_checkpoint(weights, BLOCKS["16x24"])
    names = [n for n, w in weights.items() if quantized(n, w)]
    later = set(names[::2]) | {n + "_scale_inv" for n in names[1::2]}
    shards = [
        {n: t for n, t in stored.items() if n not in later},
        {n: t for n, t in stored.items() if n in later},
    ]
    dirs["fp8-16x24-sharded"] = write_checkpoint(
        original, root / "fp8-16x24-sharded", shards, fp8_config(BLOCKS["16x24"])
    )
    dense = make_tiny(root / "dense", "deepseek_v3", seed=5, overrides={"first_k_dense_replace": 3})
    stored, _ = quantize_checkpoint(load_file(str(dense / "model.safetensors")), BLOCKS["16x24"])
    dirs["dense"] = dense
    dirs["fp8-dense"] = write_checkpoint(
        dense, root / "fp8-dense", [stored], fp8_config(BLOCKS["16x24"])
    )
    return dirs


def test_sharded_checkpoint_has_scales_before_and_after_their_weights(checkpoints) -> None:
    names = [n for n, _ in iter_safetensors(safetensors_files(checkpoints["fp8-16x24-sharded"]))]
    order = {n: i for i, n in enumerate(names)}
    pairs = [(order[n], order[n + "_scale_inv"]) for n in order if n + "_scale_inv" in order]
    assert any(w < s for w, s in pairs) and any(s < w for w, s in pairs)


def dequantized_parameters(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's parameters with each FP8 layer's weight dequantized under its plain name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            out[f"{name}.weight"] = dequantize_fp8(
                module.weight, module.weight_scale, module.block, dtype
            )
        elif isinstance(module, QuantFusedMoE):
            out[f"{name}.w13"] = dequantize_fp8(module.w13, module.w13_scale, module.block13, dtype)
            out[f"{name}.w2"] = dequantize_fp8(module.w2, module.w2_scale, module.block2, dtype)
        else:
            out |= {f"{name}.{n}": p for n, p in module.named_parameters(recurse=False)}
    return out


@pytest.mark.parametrize("variant", ["fp8-16x24", "fp8-16x24-sharded", "fp8-128x128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_layers_hold_the_checkpoints_bits(checkpoints, variant, dtype) -> None:
    path = checkpoints[variant]
    label = variant.split("-")[1]
    plain = checkpoints[f"plain-{label}"]
    scheme = ModelConfig.from_dir(path).quant.scheme_for("model.layers.1.self_attn.o_proj")
    assert (scheme.kind, scheme.block, scheme.act_group) == ("fp8", BLOCKS[label], BLOCKS[label][1])
    model = load_model(path, dtype=dtype)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear | QuantFusedMoE)]
    assert len(quantized) >= 8 and all(
        p.dtype in (torch.float8_e4m3fn, torch.float32) for m in quantized for p in m.parameters()
    )
    # The layer left out by modules_to_not_convert and MLA's kv_b_proj are plain layers.
    assert not isinstance(model.get_submodule(NOT_CONVERTED), QuantLinear)
    assert not isinstance(model.get_submodule("model.layers.1.self_attn.kv_b_proj"), QuantLinear)
    got = dequantized_parameters(model, dtype)
    want = dict(load_model(plain, dtype=dtype).named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        # The MoE router stays float32 in every model dtype, as transformers keeps it.
        router = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        assert p.dtype == (torch.float32 if router else dtype), name
        assert torch.equal(got[name], p), name


def run(path: Path, prompts: list[list[int]], max_tokens: int) -> list[torch.Tensor]:
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with captured_logits(llm) as steps:
        llm.generate(prompts, params)
    return steps


def test_logits_near_the_dequantized_checkpoint_and_the_original(checkpoints) -> None:
    vocab = ModelConfig.from_dir(checkpoints["original"]).vocab_size
    prompts = [random_prompt(20 + i, n, vocab) for i, n in enumerate([5, 23, 41])]
    # Same weights; the FP8 model also rounds its activations to FP8 per 24-element group
    # (W8A8, as the checkpoint's dynamic activation scheme says): the prefill's logits move
    # by that rounding alone.
    fp8 = run(checkpoints["fp8-16x24-sharded"], prompts, 1)[0]
    plain = run(checkpoints["plain-16x24"], prompts, 1)[0]
    err = ((fp8 - plain).norm() / plain.norm()).item()
    assert 0 < err <= ACT_LOGIT_RTOL, f"logits {err:.3f} (relative) from the dequantized weights'"
    # The prefill's logits (a row a prompt) against the unquantized weights': fp8's error only.
    fp8 = run(checkpoints["fp8-dense"], prompts, 1)[0]
    original = run(checkpoints["dense"], prompts, 1)[0]
    err = ((fp8 - original).norm() / original.norm()).item()
    assert 0 < err <= FP8_LOGIT_RTOL, f"logits {err:.3f} (relative) from the original weights'"


def test_a_missing_scale_is_refused_by_load_model(checkpoints, tmp_path) -> None:
    src = checkpoints["fp8-16x24"]
    stored = load_file(str(src / "model.safetensors"))
    del stored["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    path = write_checkpoint(src, tmp_path / "no-scale", [stored])
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.w13_scale \(3\.up\)"):
        load_model(path, dtype=torch.float32)


def test_a_missing_scale_of_a_dequantized_layer_is_refused(checkpoints, tmp_path) -> None:
    src = checkpoints["fp8-16x24"]
    stored = load_file(str(src / "model.safetensors"))
    del stored["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    path = write_checkpoint(src, tmp_path / "no-kv-b-scale", [stored])
    with pytest.raises(
        ValueError, match=r"'model\.layers\.1\.self_attn\.kv_b_proj' lacks weight_scale"
    ):
        load_model(path, dtype=torch.float32)


def fp8_tensor(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([("a.weight", fp8_tensor(20, 30))], r"quantized weight 'a' lacks weight_scale"),
        ([("a.weight_scale_inv", torch.ones(2, 2))], r"quantized weight 'a' lacks weight\b"),
        (  # 20 x 30 in 16 x 24 blocks needs a 2 x 2 scale
            [("a.weight_scale_inv", torch.ones(2, 1)), ("a.weight", fp8_tensor(20, 30))],
            r"a\.weight_scale_inv has shape \(2, 1\); weight of shape \(20, 30\) .* needs \(2, 2\)",
        ),
        (
            [("a.weight_scale_inv", torch.ones(2, 2)), ("a.weight", torch.ones(20, 30))],
            r"quantized weight 'a' lacks weight\b",
        ),
        (
            [("lm_head.weight_scale_inv", torch.ones(2, 2))],
            r"'lm_head\.weight_scale_inv' is quantized, but quantization_config leaves 'lm_head'",
        ),
    ],
    ids=[
        "weight-without-scale",
        "scale-without-weight",
        "scale-shape",
        "scale-of-unquantized",
        "ignored-layer",
    ],
)
def test_malformed_fp8_tensors_are_refused_by_name(tensors, message) -> None:
    quant = parse_quant_config(fp8_config((16, 24)))
    with pytest.raises(ValueError, match=message):
        list(quantized_tensors(tensors, quant, lambda module: True, torch.float32))


def test_fp8_tensors_without_a_quantization_config_are_refused() -> None:
    with pytest.raises(ValueError, match=r"'a\.weight' .* no quantization_config"):
        list(
            quantized_tensors([("a.weight", fp8_tensor(4, 4))], None, lambda m: True, torch.float32)
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": None}, "no weight_block_size"),
        ({"weight_block_size": [128]}, r"weight_block_size \[128\]"),
        ({"weight_block_size": [128, 0]}, r"weight_block_size \[128, 0\]"),
        ({"weight_block_size": "128x128"}, "weight_block_size '128x128'"),
    ],
)
def test_unsupported_quantization_configs_are_refused(checkpoints, changes, message) -> None:
    cfg = json.loads((checkpoints["fp8-16x24"] / "config.json").read_text())
    cfg["quantization_config"] |= changes
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(cfg)
