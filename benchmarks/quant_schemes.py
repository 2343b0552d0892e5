"""The quantization schemes the quantized benchmarks serve, as their checkpoints' config.json
spells them (benchmarks/quantized_gpu.py, and benchmarks/served_gpu.py's `--quant` beside vLLM),
and Kimi K2's dims."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gpu import SHAPES  # noqa: E402


def int4_config(group: int, ignore: list[str]) -> dict[str, Any]:
    """A compressed-tensors pack-quantized INT4 quantization_config (symmetric, one scale per
    `group` inputs) on every Linear but those `ignore` names, as llm-compressor writes it."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    weights |= {"group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": weights,
            }
        },
        "ignore": ignore,
    }


# Kimi K2.5's: the routed experts in INT4 group 32; attention, the shared experts, the dense
# MLPs and lm_head in bf16.
KIMI_K25_INT4 = int4_config(
    32,
    [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
)
# llm-compressor's W4A16 with group 128: every Linear but lm_head.
W4A16_G128 = int4_config(128, ["lm_head"])
# DeepSeek-V3 / Kimi K2 as published.
DEEPSEEK_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# moonshotai/Kimi-K2-Instruct's dims; every layer MoE (first_k_dense_replace 0), so each layer
# built is one that is timed.
KIMI_K2 = {
    **SHAPES["moonlight"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.827,
    "q_lora_rank": 1536,
    "first_k_dense_replace": 0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "type": "yarn",
        "factor": 32.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "quantization_config": DEEPSEEK_FP8,
}
SCHEMES: dict[str, dict[str, Any]] = {
    "k25-int4": KIMI_K25_INT4,
    "w4a16-g128": W4A16_G128,
    "fp8-blocks": DEEPSEEK_FP8,
}
"""`served_gpu.py --quant` names."""
