"""Architecture names from `config.json` -> ember model classes."""

from __future__ import annotations

from torch import nn

from ember.models.deepseek_v3 import DeepseekV3ForCausalLM
from ember.models.llama import LlamaForCausalLM
from ember.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}


def resolve_architecture(name: str) -> type[nn.Module]:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {name!r}; supported: {', '.join(sorted(MODELS))}"
        ) from None
