"""Dense decoder-only transformers: Llama, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).

They differ only in those two switches, read from the config, so one file serves all three.

Tensor parallel (ember.distributed): each rank holds its heads, its slice of the MLP's width and
of the vocabulary; norms are replicated. Two all-reduces a layer (after o_proj and down_proj),
one for the embedding, one gather of the logits. Built on one rank, the model is the plain one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ember.attention.context import ForwardContext
from ember.distributed.shard import shard_heads
from ember.distributed.state import current
from ember.kernels import gemv
from ember.kernels.dispatch import use_triton
from ember.models.config import ModelConfig
from ember.models.layers.activation import gated_activation
from ember.models.layers.linear import StackedLinear, make_linear
from ember.models.layers.norm import RMSNorm
from ember.models.layers.quant_linear import QuantLinear
from ember.models.layers.rotary import RotaryEmbedding
from ember.models.layers.vocab_parallel import (
    VocabParallelEmbedding,
    gather_logits,
    make_lm_head,
)
from ember.models.quant_config import QuantConfig


class Attention(nn.Module):
    """Self-attention over this rank's heads (ember.distributed.shard.shard_heads): q/k/v column
    parallel by heads (a KV head several ranks share is held whole by each), o_proj row parallel;
    `num_heads` and `num_kv_heads` are the rank's, as its KV cache is."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        s = current()
        heads = shard_heads(cfg.num_attention_heads, cfg.num_key_value_heads, s.rank, s.size)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        kv_rows = (heads.kv_head_start * d, (heads.kv_head_start + heads.num_kv_heads) * d)
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.qkv_proj = make_linear(
            cfg.hidden_size,
            {"q": q, "k": kv, "v": kv},
            cfg.quant,
            f"{prefix}.qkv_proj",
            parts={p: f"{prefix}.{p}_proj" for p in "qkv"},
            bias=cfg.attention_bias,
            parallel="column",
            rows={
                "q": (heads.head_start * d, (heads.head_start + heads.num_heads) * d),
                "k": kv_rows,
                "v": kv_rows,
            },
        )
        self.o_proj = make_linear(q, cfg.hidden_size, cfg.quant, f"{prefix}.o_proj", parallel="row")
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary  # one module shared by every layer (its caches are not saved)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        cache = ctx.kv_cache[:, self.layer_idx]
        rope_in_gemv = self._rope_in_gemv(x, cache, ctx)
        if rope_in_gemv:
            # One token (batch-1 decode): the rotation and the KV write in the q/k/v GEMV's
            # epilogue, the bits of the projection and the rotation below, one launch fewer.
            qkv = gemv.gemv_qkv_rope(
                x, self.qkv_proj.weight, positions, self.rotary.cos_cache,
                self.rotary.sin_cache, cache, ctx.metadata.slot_mapping,
                self.num_heads, self.num_kv_heads,
            )  # fmt: skip
        else:
            qkv = self.qkv_proj(x)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        kv_written = rope_in_gemv
        if not rope_in_gemv:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            # On the GPU the rotation writes K and V into their cache slots in the same launch.
            kv_written = ctx.backend.fuses_kv_write and use_triton(q)
            kv_write = (cache, v, ctx.metadata.slot_mapping) if kv_written else None
            q, k = self.rotary(positions, q, k, kv_write=kv_write)
        o = ctx.backend.forward(q, k, v, cache, ctx.metadata, self.scale, kv_written=kv_written)
        return self.o_proj(o.reshape(t, -1))

    def _rope_in_gemv(self, x: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext) -> bool:
        return (
            not self.qk_norm
            and isinstance(self.qkv_proj, StackedLinear)
            and ctx.backend.fuses_kv_write
            and gemv.rope_usable(
                x,
                self.qkv_proj.weight,
                self.qkv_proj.bias,
                self.num_heads,
                self.num_kv_heads,
                self.rotary.cos_cache,
                self.rotary.sin_cache,
                cache,
            )  # fmt: skip
        )


class MLP(nn.Module):
    """The gated MLP; `prefix` (the checkpoint's name of the module) looks up its layers'
    quantization in `quant`. Tensor parallel: gate/up column parallel, down row parallel, its
    output all-reduced unless `reduce` is False (a caller that sums it with other partial sums
    reduces once)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str,
        quant: QuantConfig | None = None,
        prefix: str = "mlp",
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(
            hidden_size,
            {"gate": intermediate_size, "up": intermediate_size},
            quant,
            f"{prefix}.gate_up_proj",
            parts={p: f"{prefix}.{p}_proj" for p in ("gate", "up")},
            parallel="column",
        )
        self.down_proj = make_linear(
            intermediate_size,
            hidden_size,
            quant,
            f"{prefix}.down_proj",
            parallel="row",
            reduce=reduce,
        )
        self.act = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.activated(self.act, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.make_attention(cfg, layer_idx, rotary)
        self.mlp = self.make_mlp(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_attention(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding
    ) -> nn.Module:
        return Attention(cfg, layer_idx, rotary)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return MLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
            cfg.quant,
            f"model.layers.{layer_idx}.mlp",
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_cls: type[DecoderLayer], max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.rope_dim,
            max(max_position, cfg.max_position_embeddings),
            cfg.rope_theta,
            cfg.rope_scaling,
        )
        self.layers = nn.ModuleList(
            layer_cls(cfg, i, self.rotary) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.run_layers: list[nn.Module] = list(self.layers)
        """The layers a forward runs: all of them, but for a dry run's cut."""
        self.aux_layers: tuple[int, ...] = ()
        """EAGLE-3: the residual-stream indices whose states a draft head reads. Index i is the
        input of layer i (the output of layer i - 1, `x + residual`): 0 is the token embedding,
        num_hidden_layers the last layer's output before the final norm (vLLM's convention)."""
        self.aux_hidden: torch.Tensor | None = None
        """After a forward with `aux_layers` set: those states concatenated, [T, len * hidden]."""

    @contextlib.contextmanager
    def layers_of_each_kind(self, per_kind: int = 1) -> Iterator[None]:
        """Within: the forward runs the first `per_kind` layers of each kind (its class, its
        attention's and its MLP's: DeepSeek's dense first layers and MoE ones are two kinds),
        in the model's order, not all of them. A dry run (ember/kernels/precompile.py) meets
        every kernel variant of the model with one of each, in a fraction of the time: the
        layers of one kind launch the same variants; the KV sizing's profiled step takes two
        (ember/engine/model_runner.py). The module tree is left as it is (`run_layers`
        changes, not `layers`): the weights may be loading into the other layers on another
        thread meanwhile (ember/models/loader.py), by their names."""
        kinds: dict[tuple[type, ...], int] = {}
        kept: list[nn.Module] = []
        for layer in self.layers:
            key = (
                type(layer),
                type(getattr(layer, "self_attn", None)),
                type(getattr(layer, "mlp", None)),
            )
            kinds[key] = kinds.get(key, 0) + 1
            if kinds[key] <= per_kind:
                kept.append(layer)
        aux_layers = self.aux_layers
        self.run_layers, self.aux_layers = kept, ()
        try:
            yield
        finally:
            self.run_layers, self.aux_layers = list(self.layers), aux_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.run_layers):
            if i in self.aux_layers:
                aux[i] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual, ctx)
        if self.aux_layers:
            if len(self.run_layers) in self.aux_layers:
                aux[len(self.run_layers)] = x + residual
            # Device-side work only (no host sync), so a captured CUDA graph replays it too.
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    layer_cls: type[DecoderLayer] = DecoderLayer
    piecewise_graphs = True
    """Steps with prompt tokens may replay piecewise CUDA graphs (ember/engine/piecewise_graphs):
    one attention call a layer through the context's backend, nothing read on the host."""
    # (our parameter, checkpoint name, shard): checkpoint matrices that land in a fused weight.
    stacked_params: tuple[tuple[str, str, str], ...] = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", "gate"),
        (".gate_up_proj.", ".up_proj.", "up"),
    )

    dense_layers: tuple[str, ...] = ()
    """Ends of checkpoint module names this model computes in its own dtype even where the
    checkpoint quantized them (their weights are dequantized as they load)."""

    def __init__(self, cfg: ModelConfig, max_position: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.layer_cls, max_position)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = make_lm_head(cfg.hidden_size, cfg.vocab_size, cfg.quant, tied)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary, on every rank."""
        return gather_logits(self.lm_head(hidden), self.config.vocab_size).float()

    def keeps_dense(self, module: str) -> bool:
        """Whether the checkpoint layer `module` is computed in the model's dtype."""
        return module.endswith(self.dense_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the names of parameters filled.
        Every rank gets the checkpoint's whole tensors: a layer's `weight_loader` keeps its
        rank's slice."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints still carry a copy
            target = self.map_weight(name, tensor, params)
            if target is not None:
                loaded.add(target)
        return loaded

    def map_weight(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> str | None:
        for ours, theirs, shard in self.stacked_params:
            if theirs in name:
                target = name.replace(theirs, ours)
                owner_name, _, attr = target.rpartition(".")
                owner = self._owner(owner_name, name)
                if isinstance(owner, QuantLinear):
                    return self._load_quantized(owner, owner_name, attr, tensor, shard, name)
                param = self._param(params, target, name)
                owner.weight_loader(param, tensor, shard)
                return target
        owner_name, _, attr = name.rpartition(".")
        owner = self._owner(owner_name, name)
        if isinstance(owner, QuantLinear):
            return self._load_quantized(owner, owner_name, attr, tensor, "", name)
        param = self._param(params, name, name)
        loader = getattr(owner, "weight_loader", None)
        if loader is not None:  # a layer that may hold a rank's slice of the tensor
            loader(param, tensor, "")
            return name
        if param.shape != tensor.shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint, "
                f"the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.data.copy_(tensor)
        return name

    @staticmethod
    def _load_quantized(
        owner: QuantLinear, owner_name: str, attr: str, tensor: torch.Tensor, shard: str, name: str
    ) -> str | None:
        filled = owner.load(attr, tensor, shard, name)
        return f"{owner_name}.{filled}" if filled else None

    def _owner(self, owner_name: str, name: str) -> nn.Module:
        try:
            return self.get_submodule(owner_name)
        except AttributeError:
            raise ValueError(f"checkpoint has weight {name!r}, which this model does not") from None

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
        try:
            return params[target]
        except KeyError:
            raise ValueError(f"checkpoint has weight {name!r}, which this model does not") from None
