"""DeepSeek-V3 / Kimi K2 (`DeepseekV3ForCausalLM`): multi-head latent attention over a paged
latent cache, and mixture-of-experts layers with sigmoid grouped routing and shared experts after
`first_k_dense_replace` dense layers.

Attention (ember/attention/mla.py) on a GPU runs decode rows and short extends in the latent space
through the Triton MLA decode kernel (ember/kernels/mla_decode.py, CUDA-graph safe) and long
prefills with K/V expanded per head through torch's fused attention; on the CPU in the latent
space through the PyTorch reference. The routed experts run in the fused MoE grouped GEMM
(ember/kernels/fused_moe.py) on a GPU, and with them, at decode-sized batches, the shared experts
(stored as more experts of the same stacked weights).

Tensor parallel: attention splits by heads (`MLAttention`) and the MoE layers by width or by
expert (ember/models/layers/moe.py), each layer's partial sums all-reduced once.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ember.attention.context import ForwardContext
from ember.attention.mla import mla_attention
from ember.distributed import comm
from ember.distributed.shard import shard_size
from ember.distributed.state import ParallelState, current, use
from ember.kernels.dispatch import use_triton
from ember.models.config import ModelConfig
from ember.models.layers.linear import make_linear, quant_scheme
from ember.models.layers.moe import grouped_topk
from ember.models.layers.norm import RMSNorm
from ember.models.layers.quant_moe import QuantFusedMoE, make_fused_moe
from ember.models.layers.rotary import RotaryEmbedding, rope_type, yarn_mscale
from ember.models.llama import MLP, DecoderLayer
from ember.models.qwen3_moe import Qwen3MoeForCausalLM, expert_scheme

# model.layers.L.mlp.shared_experts.{gate,up,down}_proj.weight: loaded into the stacked experts.
_SHARED = re.compile(
    r"^(.*\.mlp)\.shared_experts\.(gate|up|down)_proj\."
    r"(weight|weight_packed|weight_scale|weight_zero_point|weight_shape)$"
)


class MLAttention(nn.Module):
    """Multi-head latent attention over this rank's heads (`num_heads` of them, from
    `head_start`): q's up-projection (q_b_proj, or the plain q_proj) and kv_b_proj hold the
    rank's heads' rows, o_proj its heads' columns (row parallel, all-reduced). The latent
    projection (kv_a_proj_with_mqa), q's LoRA down-projection and their norms are replicated:
    every rank computes the same latent row and keeps the whole latent cache, since one latent
    head, shared by every query head, cannot be split.

    Data-parallel attention (`ParallelState.dp_attention`) splits the requests instead: every
    rank holds every head's weights and attends only to its own requests' rows (`ctx.dp_rows`)
    over its own latent cache; their outputs, each in its rows of a zeroed [tokens, hidden],
    are summed over the ranks, so every rank again holds every token for the MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.data_parallel = current().dp_attention
        if self.data_parallel:  # every head on every rank: the layers of one rank
            with use(ParallelState()):
                self._build(cfg, layer_idx, rotary)
        else:
            self._build(cfg, layer_idx, rotary)

    def _build(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        self.layer_idx = layer_idx
        s = current()
        heads = cfg.num_attention_heads
        self.num_heads = h = shard_size(heads, s.size, "num_attention_heads")
        self.head_start = h0 = s.rank * h
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        q_rows = (h0 * qk, (h0 + h) * qk)  # the rank's heads' rows of q
        # The two projections of x (q's, or q's LoRA down-projection, and the latent's) are one
        # matmul: one launch fewer a layer, which is what batch-1 decode pays for. A plain q_proj
        # is split by heads in it; the latent's rows are whole on every rank.
        self.q_lora = bool(cfg.q_lora_rank)
        q_out = cfg.q_lora_rank if self.q_lora else heads * qk
        kv_a = self.rank + self.rope
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.fused_qkv_a_proj = make_linear(
            cfg.hidden_size,
            {"q": q_out, "kv_a": kv_a},
            cfg.quant,
            f"{prefix}.fused_qkv_a_proj",
            parts={
                "q": f"{prefix}.{'q_a_proj' if self.q_lora else 'q_proj'}",
                "kv_a": f"{prefix}.kv_a_proj_with_mqa",
            },
            parallel=None if self.q_lora else "column",
            rows=None if self.q_lora else {"q": q_rows, "kv_a": (0, kv_a)},
        )
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = make_linear(
                cfg.q_lora_rank,
                heads * qk,
                cfg.quant,
                f"{prefix}.q_b_proj",
                parallel="column",
                rows=q_rows,
            )
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        # Attention splits this weight per head (w_uk, w_uv): it stays in the model's dtype,
        # dequantized as it loads if the checkpoint quantized it (`dense_layers`).
        kv_b = self.nope + self.v_dim
        self.kv_b_proj = make_linear(
            self.rank,
            heads * kv_b,
            None,
            f"{prefix}.kv_b_proj",
            parallel="column",
            rows=(h0 * kv_b, (h0 + h) * kv_b),
        )
        self.o_proj = make_linear(
            heads * self.v_dim, cfg.hidden_size, cfg.quant, f"{prefix}.o_proj", parallel="row"
        )
        self.interleaved = bool(cfg.raw.get("rope_interleave", True))
        self.scale = qk**-0.5
        scaling = cfg.rope_scaling
        if scaling is not None and rope_type(scaling) == "yarn" and scaling.get("mscale_all_dim"):
            # YaRN stretches the context; DeepSeek scales the softmax up to match (mscale^2).
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        self.rotary = rotary

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if not self.data_parallel or (ctx.dp_rows is None and ctx.dp_foreign is None):
            return self._attend(positions, x, ctx)
        if ctx.dp_foreign is not None:  # a decode graph's rows: the others' are padding here
            o = self._attend(positions, x, ctx).masked_fill_(ctx.dp_foreign.unsqueeze(1), 0)
            return comm.all_reduce(o)
        # This rank's requests' rows, attended here; the others' come from their ranks.
        rows = ctx.dp_rows
        out = torch.zeros_like(x)
        if rows.numel():
            out.index_copy_(0, rows, self._attend(positions[rows], x[rows], ctx))
        return comm.all_reduce(out)

    def _attend(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        q, kv = self.fused_qkv_a_proj.split(self.fused_qkv_a_proj(x))
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope_in = q.view(t, h, -1).split([self.nope, self.rope], dim=-1)
        # The latent row [normed c_kv, rotated k_rope] and the rotated q_rope are written in place
        # by the norm and the rotation (which also deinterleaves): no split copies, no concat.
        latent = torch.empty(t, self.rank + self.rope, dtype=x.dtype, device=x.device)
        self.kv_a_layernorm(kv[:, : self.rank], out=latent[:, : self.rank])
        q_rope = torch.empty(t, h, self.rope, dtype=q.dtype, device=q.device)
        self.rotary(
            positions,
            q_rope_in,
            kv[:, self.rank :].unsqueeze(1),
            interleaved=self.interleaved,
            q_out=q_rope,
            k_out=latent[:, self.rank :].unsqueeze(1),
        )
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        cache = ctx.kv_cache[:, self.layer_idx]
        backend = ctx.backend
        attend = backend.mla if backend.takes_mla else mla_attention
        o = attend(q_nope, q_rope, latent, w_uk, w_uv, cache, ctx.metadata, self.scale)
        return self.o_proj(o.reshape(t, h * self.v_dim))


ROUTER_KERNEL_MAX_TOKENS = 64
"""Decode-sized batches take the router's logits from one Triton launch (x cast in registers);
larger ones from cuBLAS on x.float(), where the cast's extra pass is small beside the matmul."""


class Router(nn.Module):
    """The MoE gate: fp32 logits over the experts, and the correction bias that balances load.

    Both stay float32 whatever the model's dtype, as transformers keeps them
    (`_keep_in_fp32_modules_strict`): a bf16 bias would round the scores experts are chosen on,
    and the weight is not cast again every step."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and x.shape[0] <= ROUTER_KERNEL_MAX_TOKENS:
            from ember.kernels.moe_routing import router_logits

            return router_logits(x, self.weight)
        return F.linear(x.float(), self.weight)


FUSED_SHARED_MAX_TOKENS = 64
"""Batches of up to this many tokens run the shared experts as always-on experts of the fused MoE
(SGLang's shared-expert fusion): four launches fewer a layer (the shared MLP's two matmuls, its
activation and the add), which is what decode pays for. Larger batches run them through cuBLAS
on views of the same weights, which outruns the grouped GEMM on prefill-sized rows."""


class DeepseekMoE(nn.Module):
    """Routed experts (FusedMoE) and shared ones. On a tensor-parallel engine every part gives a
    partial sum, and the layer all-reduces their total once.

    The shared experts are stacked after the routed ones when stored alike and split alike (by
    width). Under expert parallel they are an MLP of their own split by width (column then row
    parallel, not reduced by itself), computed on every rank: not held whole on each rank and
    added on one, which would hold S experts' weights on every rank and make that one rank read
    them every step on top of its routed share (at decode about as many bytes again as its
    routed experts), the step waiting on it."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        prefix = f"model.layers.{layer_idx}.mlp"
        routed = expert_scheme(cfg, prefix)
        shared = quant_scheme(
            cfg.quant, [f"{prefix}.shared_experts.{p}_proj" for p in ("gate", "up", "down")]
        )
        # The shared MLP (intermediate n_shared_experts * moe_intermediate_size) is stored as
        # n_shared_experts more experts after the routed ones (FusedMoE's docstring says why),
        # unless it is stored otherwise than they are (Kimi K2.5: INT4 routed experts, a 16-bit
        # shared MLP): it is then an MLP of its own, as under expert parallel (the class's
        # docstring says why).
        s = current()
        by_expert = s.is_parallel and s.expert_parallel
        fused = cfg.n_shared_experts if shared == routed and not by_expert else 0
        self.experts = make_fused_moe(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.hidden_act,
            routed,
            f"{prefix}.experts",
            num_shared=fused,
        )
        self.shared_experts: MLP | None = None
        if cfg.n_shared_experts and not fused:
            self.shared_experts = MLP(
                cfg.hidden_size,
                cfg.n_shared_experts * cfg.moe_intermediate_size,
                cfg.hidden_act,
                cfg.quant,
                f"{prefix}.shared_experts",
                reduce=False,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        num_shared = self.experts.num_shared
        # Quantized experts run their shared ones in the grouped GEMM at every batch size.
        fuse_shared = num_shared > 0 and (
            x.shape[0] <= FUSED_SHARED_MAX_TOKENS or isinstance(self.experts, QuantFusedMoE)
        )
        weights, experts = grouped_topk(
            self.gate(x),
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            num_shared=num_shared if fuse_shared else 0,
        )
        out = self.experts.routed(x, weights, experts)
        if num_shared and not fuse_shared:
            out = out + self.experts.shared(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return comm.all_reduce(out)


class DeepseekV3DecoderLayer(DecoderLayer):
    def make_attention(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding
    ) -> nn.Module:
        return MLAttention(cfg, layer_idx, rotary)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        if cfg.is_moe_layer(layer_idx):
            return DeepseekMoE(cfg, layer_idx)
        return super().make_mlp(cfg, layer_idx)


class DeepseekV3ForCausalLM(Qwen3MoeForCausalLM):
    layer_cls = DeepseekV3DecoderLayer
    dense_layers = (".kv_b_proj", ".mlp.gate")
    piecewise_graphs = True
    """Steps with prompt tokens replay piecewise CUDA graphs, split at each layer's MLA call
    (`AttentionBackend.mla`), as the other models' at their attention call."""
    # The MLPs' gate and up, and MLA's two projections of the hidden state, load fused.
    stacked_params = (
        (".gate_up_proj.", ".gate_proj.", "gate"),
        (".gate_up_proj.", ".up_proj.", "up"),
        (".fused_qkv_a_proj.", ".q_proj.", "q"),
        (".fused_qkv_a_proj.", ".q_a_proj.", "q"),
        (".fused_qkv_a_proj.", ".kv_a_proj_with_mqa.", "kv_a"),
    )

    def __init__(self, cfg: ModelConfig, max_position: int = 0) -> None:
        if not cfg.uses_mla:
            raise ValueError("DeepseekV3ForCausalLM needs an MLA config (kv_lora_rank > 0)")
        super().__init__(cfg, max_position)

    def map_weight(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> str | None:
        m = _SHARED.match(name)
        if m is None:
            return super().map_weight(name, tensor, params)
        prefix, part, attr = m.groups()
        experts = self.get_submodule(f"{prefix}.experts")
        if not experts.num_shared:  # a shared MLP of its own: loads as an MLP
            return super().map_weight(name, tensor, params)
        if isinstance(experts, QuantFusedMoE):
            filled = experts.load(attr, tensor, f"shared.{part}", name)
            return f"{prefix}.experts.{filled}" if filled else None
        target = f"{prefix}.experts.{'w2' if part == 'down' else 'w13'}"
        param = self._param(params, target, name)
        self.get_submodule(f"{prefix}.experts").weight_loader(param, tensor, f"shared.{part}")
        return target
