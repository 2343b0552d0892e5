"""Quantized tiny models on the GPU path (the Triton kernels that dequantize in registers, CUDA
graphs and eager): every step's logits against ember's CPU reference on the same quantized
checkpoint, and greedy tokens against it. Runs only where CUDA is available."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.models.layers.quant_linear import QuantLinear
from ember.models.loader import load_model
from tests.capture import captured_logits
from tests.models.quant_checkpoints import make_quantized
from tests.models.test_quantized_models import prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CASES = [
    "llama_w4a16_g32",
    "llama_w4a16_asym_g128",
    "llama_w8a16_channel",
    "qwen3_moe_w4a16_experts",
    "deepseek_v3_int4",
    "llama_fp8_dynamic",
    "llama_fp8_block",
]
NEW_TOKENS = 6
RTOL = 2e-3
"""Relative (Frobenius) distance of the GPU's prefill logits from the CPU reference's, float32:
the kernels' order of summation against torch's."""
FP8_RTOL = 0.1
"""The same for FP8 (W8A8) models: the layers agree to 1e-7 on the same inputs
(`test_fp8_layers_match_the_cpu_reference`), but an activation that the float32 sums of
attention or a norm put within 1e-7 of an FP8 rounding boundary rounds the other way on one
side, moving it by up to 1/16; on the random tiny models that moves the prefill's logits by
0.05 (H200)."""
LAYER_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def run(path: Path, device: str, eager: bool = True) -> tuple[list[torch.Tensor], list[list[int]]]:
    llm = LLM(
        str(path),
        device=device,
        dtype="float32",
        max_model_len=128,
        block_size=16 if device == "cuda" else 4,
        enforce_eager=eager,
        num_kv_blocks=256 if device == "cuda" else None,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with captured_logits(llm) as steps:
        outs = llm.generate(prompts(path), params)
    return steps, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("case", CASES)
def test_gpu_matches_the_cpu_reference(case: str, eager: bool, tmp_path: Path) -> None:
    _, quantized, _ = make_quantized(tmp_path, case, seed=7)
    cpu_steps, cpu_tokens = run(quantized, "cpu")
    gpu_steps, gpu_tokens = run(quantized, "cuda", eager)
    got, want = gpu_steps[0].cpu(), cpu_steps[0]
    err = ((got - want).norm() / want.norm()).item()
    bound = FP8_RTOL if "fp8" in case else RTOL
    assert err <= bound, f"prefill logits {err:.2e} (relative) from the CPU reference's"
    # FP8 activations round on each side of a near-tie now and then; INT weights do not.
    agree = sum(a == b for a, b in zip(gpu_tokens, cpu_tokens, strict=True))
    assert agree == len(cpu_tokens) or ("fp8" in case and agree >= len(cpu_tokens) - 1)


@pytest.mark.parametrize("case", ["llama_fp8_dynamic", "llama_fp8_tensor", "llama_fp8_block"])
def test_fp8_layers_match_the_cpu_reference(case: str, tmp_path: Path) -> None:
    """Every FP8 layer on the GPU (activations quantized by a kernel, FP8 tensor cores) against
    the same layer on the CPU, on the same float32 inputs; the parameters loaded bit for bit."""
    _, quantized, _ = make_quantized(tmp_path, case, seed=7)
    cpu = load_model(quantized, dtype=torch.float32)
    gpu = load_model(quantized, dtype=torch.float32, device="cuda")
    on_gpu = dict(gpu.named_parameters())
    for name, p in cpu.named_parameters():
        assert torch.equal(p, on_gpu[name].cpu()), name
    layers = [(n, m) for n, m in cpu.named_modules() if isinstance(m, QuantLinear)]
    assert layers
    g = torch.Generator().manual_seed(0)
    for name, layer in layers:
        x = torch.randn(37, layer.in_features, generator=g)
        want = layer(x)
        got = gpu.get_submodule(name)(x.cuda()).cpu()
        err = ((got - want).norm() / want.norm()).item()
        assert err <= LAYER_RTOL, f"{name}: {err:.2e}"
