"""Qwen3-MoE: the Qwen3 decoder with sparse mixture-of-experts MLPs."""

from __future__ import annotations

import re

import torch
from torch import nn

from ember.models.config import ModelConfig
from ember.models.layers.moe import SparseMoeBlock
from ember.models.llama import MLP, DecoderLayer, LlamaForCausalLM

# Per-expert checkpoint names: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# transformers 5 may save them already stacked: mlp.experts.{gate_up_proj,down_proj}
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj$")


class Qwen3MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if not cfg.is_moe_layer(layer_idx):
            return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.hidden_act,
        )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    # Inherits piecewise_graphs: the MoE layers are graph safe (routing, expert alignment and the
    # grouped GEMMs on the device, shapes from the token count alone).

    def map_weight(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> str | None:
        m = _EXPERT.match(name)
        if m:
            prefix, expert, part = m.groups()
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
