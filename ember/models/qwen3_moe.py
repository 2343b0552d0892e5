"""Qwen3-MoE: the Qwen3 decoder with sparse mixture-of-experts MLPs."""

from __future__ import annotations

import re

import torch
from torch import nn

from ember.models.config import ModelConfig
from ember.models.layers.linear import quant_scheme
from ember.models.layers.moe import FusedMoE, SparseMoeBlock
from ember.models.layers.quant_moe import QuantFusedMoE, make_fused_moe
from ember.models.llama import DecoderLayer, LlamaForCausalLM
from ember.models.quant_config import WeightQuant

# Per-expert checkpoint names: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight, or a
# quantized checkpoint's weight_packed, weight_scale, ... in place of weight.
_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\."
    r"(weight|weight_packed|weight_scale|weight_zero_point|weight_shape)$"
)
# transformers 5 may save them already stacked: mlp.experts.{gate_up_proj,down_proj}
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj$")


def expert_scheme(cfg: ModelConfig, prefix: str) -> WeightQuant | None:
    """The quantization of the routed experts under `prefix` (the MLP's checkpoint name), read
    from expert 0's gate, up and down (a checkpoint quantizes its experts alike)."""
    return quant_scheme(cfg.quant, [f"{prefix}.experts.0.{p}_proj" for p in ("gate", "up", "down")])


class Qwen3MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if not cfg.is_moe_layer(layer_idx):
            return super().make_mlp(cfg, layer_idx)
        prefix = f"model.layers.{layer_idx}.mlp"
        experts = make_fused_moe(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.hidden_act,
            expert_scheme(cfg, prefix),
            f"{prefix}.experts",
        )
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.hidden_act,
            experts,
        )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    dense_layers = (".mlp.gate",)
    # Inherits piecewise_graphs: the MoE layers are graph safe (routing, expert alignment and the
    # grouped GEMMs on the device, shapes from the token count alone).

    def expert_load(self) -> torch.Tensor | None:
        """Under expert parallel: [MoE layers, this rank's experts] int64 on the device, the
        (token, expert) pairs routed to each of this rank's experts since the model was built
        (FusedMoE.expert_load), for the engine's metrics; None otherwise. A fresh tensor, read
        off the step (the forward never syncs on it)."""
        loads = [
            m.expert_load
            for m in self.modules()
            if isinstance(m, FusedMoE) and m.expert_load is not None
        ]
        return torch.stack(loads) if loads else None

    def map_weight(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> str | None:
        m = _EXPERT.match(name)
        if m:
            prefix, expert, part, attr = m.groups()
            experts = self.get_submodule(prefix)
            if isinstance(experts, QuantFusedMoE):
                filled = experts.load(attr, tensor, f"{expert}.{part}", name)
                return f"{prefix}.{filled}" if filled else None
            if attr != "weight":
                raise ValueError(
                    f"checkpoint tensor {name!r} is quantized, but the model's experts are not"
                )
            target = f"{prefix}.{'w2' if part == 'down' else 'w13'}"
            shard = f"{expert}.{part}"
        elif m := _STACKED.match(name):
            prefix, part = m.groups()
            target = f"{prefix}.{'w2' if part == 'down' else 'w13'}"
            shard = part
        else:
            return super().map_weight(name, tensor, params)
        param = self._param(params, target, name)
        self.get_submodule(prefix).weight_loader(param, tensor, shard)
        return target
