"""Tiny quantized checkpoints written by compressed-tensors' own compressor
(tests/models/quant_checkpoints.py), served by ember with their weights kept quantized.

Oracles ember did not write: compressed-tensors' decompression (the dequantized twin of each
checkpoint) and transformers, which reads compressed-tensors. INT4 / INT8 models give, at every
step, the same logits as ember on the dequantized twin, bit for bit (both compute the weight as
compressed-tensors does, then the same matmul); FP8 models (W8A8: activations quantized per token
or per group as the checkpoint says) sit within the activations' rounding of it; and ember's
greedy tokens in float32 equal transformers' on the quantized INT checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from ember import LLM, SamplingParams
from ember.models.config import ModelConfig
from ember.models.layers.quant_linear import QuantLinear
from ember.models.layers.quant_moe import QuantFusedMoE
from ember.models.loader import load_model
from tests.capture import captured_logits
from tests.models.hf_reference import hf_greedy
from tests.models.quant_checkpoints import make_quantized
from tests.models.test_vs_transformers import random_prompt

INT_CASES = [
    "llama_w4a16_g32",
    "llama_w4a16_asym_g128",
    "llama_w8a16_channel",
    "qwen3_moe_w4a16_experts",
    "kimi_k2_int4",
    "deepseek_v3_int4",
]
FP8_CASES = ["llama_fp8_dynamic", "llama_fp8_tensor", "llama_fp8_block"]
NEW_TOKENS = 6
FP8_LOGIT_RTOL = 0.1
"""FP8 activations' rounding: the prefill's logits within this (relative, Frobenius) of the
dequantized weights' with 16-bit activations (measured 0.047-0.061 on these models)."""

Made = Callable[[str], tuple[Path, Path, Path]]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Made:
    """case -> (original, quantized, dequantized) checkpoint paths, each made once."""
    cache: dict[str, tuple[Path, Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path, Path]:
        if case not in cache:
            cache[case] = make_quantized(tmp_path_factory.mktemp(case), case, seed=7)
        return cache[case]

    return get


def prompts(path: Path) -> list[list[int]]:
    vocab = ModelConfig.from_dir(path).vocab_size
    return [random_prompt(40 + i, n, vocab) for i, n in enumerate([4, 17, 33])]


def step_logits(path: Path, dtype: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    llm = LLM(str(path), dtype=dtype, block_size=4, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with captured_logits(llm) as steps:
        outs = llm.generate(prompts(path), params)
    return steps, [list(o.outputs[0].token_ids) for o in outs]


def quantized_layers(path: Path) -> list[torch.nn.Module]:
    model = load_model(path, dtype=torch.bfloat16)
    return [m for m in model.modules() if isinstance(m, QuantLinear | QuantFusedMoE)]


@pytest.mark.parametrize("case", INT_CASES)
def test_int_models_equal_the_dequantized_checkpoint(case: str, made: Made) -> None:
    _, quantized, dequantized = made(case)
    layers = quantized_layers(quantized)
    assert layers and all(
        p.dtype in (torch.int32, torch.int8, torch.bfloat16) for m in layers for p in m.parameters()
    )
    if case.startswith(("kimi", "deepseek", "qwen3_moe")):
        # Only the routed experts are quantized; attention and the rest stay bf16.
        assert all(isinstance(m, QuantFusedMoE) for m in layers)
    got, got_tokens = step_logits(quantized, "bfloat16")
    want, want_tokens = step_logits(dequantized, "bfloat16")
    assert len(got) == len(want) == NEW_TOKENS
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {j}: max |diff| {(a - b).abs().max():.3g}"
    assert got_tokens == want_tokens


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_models_near_the_dequantized_checkpoint(case: str, made: Made) -> None:
    _, quantized, dequantized = made(case)
    layers = quantized_layers(quantized)
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    got, _ = step_logits(quantized, "float32")
    want, _ = step_logits(dequantized, "float32")
    # The prefill's logits (a row a prompt): later steps may follow other tokens (random tiny
    # weights have near-ties that the activations' rounding flips).
    err = ((got[0] - want[0]).norm() / want[0].norm()).item()
    assert 0 < err <= FP8_LOGIT_RTOL, f"prefill logits {err:.3f} (relative) apart"


def hf_model(path: Path) -> torch.nn.Module:
    """transformers on the quantized checkpoint in float32, decompressing it as it loads."""
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()


@pytest.mark.parametrize("case", [c for c in INT_CASES if not c.startswith("kimi")])
def test_greedy_tokens_equal_transformers(case: str, made: Made) -> None:
    """transformers reads the quantized checkpoint (decompressing it with compressed-tensors) and
    decodes greedily in float32; so does ember with its weights quantized. (Kimi K2's
    architecture is not in transformers; its tiny model is DeepSeek-V3's. FP8 models quantize
    their activations, which transformers' decompressed load does not.)"""
    _, quantized, _ = made(case)
    _, tokens = step_logits(quantized, "float32")
    hf = hf_model(quantized)
    for prompt, got in zip(prompts(quantized), tokens, strict=True):
        assert got == hf_greedy(hf, prompt, NEW_TOKENS)
