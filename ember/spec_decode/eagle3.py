"""EAGLE-3 draft heads: one decoder layer over three of the target's hidden states, drafting K
tokens per step with its own paged KV cache.

The checkpoint layout is the published one (SpecForge, `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`, read
by vLLM and SGLang): config.json with architectures ["LlamaForCausalLMEagle3"], the Llama shape
fields, `draft_vocab_size` and optionally `target_hidden_size` and `eagle_aux_hidden_state_layer_ids`;
weights `fc.weight` [H, 3 * H_target], `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2 * H:
the normed token embedding, then the normed hidden state), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` [draft_vocab] (target id = draft id +
d2t[draft id]) and `t2d` [vocab] (bool). The token embedding is the target's unless the checkpoint
carries `embed_tokens.weight`. config.json is read and checked in ember/spec_decode/eagle3_config.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ember.attention.backend import AttentionBackend
from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.distributed import state as parallel_state
from ember.models.checkpoint_files import safetensors_files
from ember.models.config import ModelConfig
from ember.models.layers.linear import StackedLinear
from ember.models.layers.norm import RMSNorm
from ember.models.layers.rotary import RotaryEmbedding
from ember.models.llama import MLP, Attention, LlamaForCausalLM
from ember.models.loader import check_complete
from ember.models.weight_staging import iter_safetensors
from ember.spec_decode.eagle3_chain import chain_drafts
from ember.spec_decode.eagle3_config import Eagle3Config
from ember.spec_decode.eagle3_config import default_aux_layers as default_aux_layers  # re-export


class Eagle3Layer(nn.Module):
    """The `midlayer`: a Llama decoder layer whose attention reads [norm(embedding), norm(hidden)]."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, norm_before_residual: bool):
        super().__init__()
        self.self_attn = Attention(cfg, 0, rotary)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.self_attn.qkv_proj = StackedLinear(
            2 * cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.attention_bias
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class Eagle3DraftModel(nn.Module):
    def __init__(
        self, cfg: Eagle3Config, embed_tokens: nn.Embedding | None = None, max_position: int = 0
    ) -> None:
        super().__init__()
        layer = cfg.layer
        self.config = cfg
        # The target's embedding is shared, not copied: it is the same table the target reads.
        self.embed_tokens = embed_tokens or nn.Embedding(layer.vocab_size, layer.hidden_size)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, layer.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(
            layer.head_dim,
            max(max_position, layer.max_position_embeddings),
            layer.rope_theta,
            layer.rope_scaling,
        )
        self.midlayer = Eagle3Layer(layer, self.rotary, cfg.norm_before_residual)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = nn.Linear(layer.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """hidden [T, H]: `fc(aux)` where the target's states are known, else the draft's own
        output. Returns the layer's output before the final norm: what a chained step feeds back."""
        return self.midlayer(positions, self.embed_tokens(input_ids), hidden, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary, [T, draft_vocab]."""
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a published-layout checkpoint in, refusing unknown, missing or misshapen tensors."""
        params = dict(self.named_parameters())
        shared = "embed_tokens.weight" not in weights
        loaded: set[str] = {"embed_tokens.weight"} if shared else set()
        vocab, draft_vocab = self.config.layer.vocab_size, self.config.draft_vocab_size
        for name, tensor in weights.items():
            if name == "t2d":
                _check_shape(name, tensor, (vocab,))
            elif name == "d2t":
                _check_shape(name, tensor, (draft_vocab,))
                target_ids = torch.arange(draft_vocab) + tensor.long()
                if target_ids.min() < 0 or target_ids.max() >= vocab:
                    raise ValueError(
                        f"d2t maps draft ids outside the target vocabulary [0, {vocab})"
                    )
                self.d2t.copy_(tensor)
            else:
                loaded.add(self._load_one(name, tensor, params))
        if "d2t" not in weights and draft_vocab != vocab:
            raise ValueError(
                f"draft_vocab_size {draft_vocab} < vocab_size {vocab} needs a d2t map, "
                "which the checkpoint lacks"
            )
        check_complete(self, loaded, "EAGLE-3 checkpoint")

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> str:
        for ours, theirs, shard in LlamaForCausalLM.stacked_params:
            if theirs in name:
                target = name.replace(theirs, ours)
                if target not in params:
                    break
                owner = self.get_submodule(target.rsplit(".", 1)[0])
                _check_shape(name, tensor, (owner.shard_sizes[shard], *params[target].shape[1:]))
                owner.weight_loader(params[target], tensor, shard)
                return target
        if name not in params:
            raise ValueError(f"EAGLE-3 checkpoint has weight {name!r}, which the head does not")
        _check_shape(name, tensor, tuple(params[name].shape))
        with torch.no_grad():
            params[name].copy_(tensor)
        return name

    def published_weights(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the published names (the inverse of `load_weights`)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if name == "embed_tokens.weight":
                continue
            fused = [s for s in LlamaForCausalLM.stacked_params if s[0] in name]
            for ours, theirs, shard in fused:
                owner = self.get_submodule(name.rsplit(".", 1)[0])
                off, size = owner.shard_offsets[shard], owner.shard_sizes[shard]
                out[name.replace(ours, theirs)] = p.detach()[off : off + size].clone()
            if not fused:
                out[name] = p.detach().clone()
        out["d2t"] = self.d2t.clone()
        t2d = torch.zeros(self.config.layer.vocab_size, dtype=torch.bool)
        t2d[torch.arange(self.config.draft_vocab_size) + self.d2t.cpu()] = True
        out["t2d"] = t2d
        return out


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"EAGLE-3 weight {name!r} has shape {tuple(tensor.shape)}, the head expects {shape}"
        )


def read_weights(draft_dir: Path) -> dict[str, torch.Tensor]:
    """*.safetensors, else the pytorch_model.bin that the first EAGLE-3 releases shipped."""
    try:
        return dict(iter_safetensors(safetensors_files(draft_dir)))
    except FileNotFoundError:
        bin_file = draft_dir / "pytorch_model.bin"
        if not bin_file.is_file():
            raise
        return torch.load(bin_file, map_location="cpu", weights_only=True)


TARGET_EMBEDDING = "model.embed_tokens.weight"


def target_embedding(target_dir: str | Path) -> torch.Tensor:
    """The target's whole token embedding, read from its safetensors files: a tensor-parallel
    target holds 1/N of the vocabulary a rank, and its lookup is a collective the head (run on
    rank 0 alone) cannot join."""
    for path in safetensors_files(Path(target_dir)):
        with safe_open(str(path), framework="pt") as f:
            if TARGET_EMBEDDING in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                return f.get_tensor(TARGET_EMBEDDING)
    raise ValueError(
        f"an EAGLE-3 head on a tensor-parallel target needs {TARGET_EMBEDDING!r} in the target's "
        f"safetensors files ({target_dir}) or its own embed_tokens.weight"
    )


def load_eagle3(
    draft_dir: str | Path,
    target: nn.Module,
    dtype: torch.dtype,
    device: str | torch.device,
    target_dir: str | Path | None = None,
) -> Eagle3DraftModel:
    """The head in `draft_dir`, checked against `target` (a LlamaForCausalLM), on `device`. A
    target split by vocabulary across ranks (`target_dir`: its checkpoint) lends the head a copy
    of its whole embedding instead of its own shard."""
    draft_dir = Path(draft_dir)
    cfg = Eagle3Config.from_dir(draft_dir)
    weights = read_weights(draft_dir)
    own_embedding = "embed_tokens.weight" in weights
    cfg.check_target(target.config, own_embedding)
    shard = getattr(target.model.embed_tokens, "vocab", None)
    if not own_embedding and shard is not None and shard.parallel:
        if target_dir is None:
            raise ValueError("a tensor-parallel target's EAGLE-3 head needs the target's path")
        weights["embed_tokens.weight"] = target_embedding(target_dir)
        own_embedding = True
    embed = None if own_embedding else target.model.embed_tokens
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    # Whole layers, whatever the target's split: the head runs on one rank, with no collective.
    with parallel_state.use(parallel_state.ParallelState()):
        try:
            with torch.device(device):
                model = Eagle3DraftModel(
                    cfg, embed, max_position=target.model.rotary.cos_cache.shape[0]
                )
        finally:
            torch.set_default_dtype(old)
        model.load_weights(weights)
    return model.eval()


@dataclass(slots=True)
class DraftRow:
    """One request's new positions: those whose target hidden state the last step produced."""

    block_ids: list[int]
    """The request's block table; the draft cache uses the same block ids as the target's."""
    start: int
    """Position p of the first row."""
    token_ids: list[int]
    """For each position p in [start, start + n): token t_{p+1}, the token that followed p."""
    aux_hidden: torch.Tensor
    """[n, 3 * H_target]: the target's aux hidden states at those positions."""


class Eagle3Drafter:
    """Drafts K tokens per request from the target's hidden states (what the engine calls).

    Drafting is greedy: each draft is the argmax of the head's logits, a deterministic function of
    the context. The engine's rejection sampler treats such a draft as a point mass (q(d) = 1):
    it accepts d with probability p(d) and on rejection samples from p with d removed, so the
    output distribution is exactly the target's for any temperature, top-p, top-k or penalty.
    """

    def __init__(
        self,
        draft_dir: str,
        target: nn.Module,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
        target_dir: str | Path | None = None,
    ) -> None:
        """`target_dir`: the target's checkpoint, read for its whole embedding when the target
        is split across tensor-parallel ranks (the head runs on rank 0 alone, over the states
        every rank holds whole)."""
        self.model = load_eagle3(draft_dir, target, dtype, device, target_dir)
        self.aux_layers: tuple[int, ...] = self.model.config.aux_layers_for(target.config)
        # The target hands these states out from now on; build the drafter before capturing the
        # target's CUDA graphs, so that the graphs record the extra copies too.
        target.model.aux_layers = self.aux_layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.backend = backend
        self.kv_cache = torch.empty(0, dtype=dtype, device=device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One layer's KV over the same block ids as the target's cache (so the same count)."""
        self.kv_cache = torch.zeros(
            (num_blocks, *self._block_shape()), dtype=self.dtype, device=self.device
        )

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of the head's KV per block: the engine sizes its pool for both caches."""
        return math.prod(self._block_shape()) * torch.tensor([], dtype=self.dtype).element_size()

    def _block_shape(self) -> tuple[int, ...]:
        cfg = self.model.config.layer
        return (1, 2, self.block_size, cfg.num_key_value_heads, cfg.head_dim)

    @torch.inference_mode()
    def propose(self, rows: list[DraftRow], k: int) -> list[list[int]]:
        """Write the draft KV of every row's positions (token t_{p+1} with target hidden h_p),
        then chain k greedy steps from each row's last position (the draft's own output hidden
        feeding the next step, KV at positions start+n, start+n+1, ...); return k target-vocabulary
        token ids per row. Positions after a row's last are overwritten by the next call, which
        starts at the first position the target has not verified. k = 0 only writes the rows'
        KV (a prefill chunk, or a request that does not speculate this step)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if not rows:
            return []
        if self.kv_cache.numel() == 0:
            raise RuntimeError("Eagle3Drafter.propose before allocate_kv_cache")
        # Single-token rows first: the attention backend runs them through its decode kernel.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids) != 1)
        spans = [self._span(rows[i], k) for i in order]
        tables = [rows[i].block_ids for i in order]
        width = max(len(t) for t in tables)
        block_tables = self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)
        ids = self._tensor([t for i in order for t in rows[i].token_ids], torch.int64)
        aux = torch.cat([rows[i].aux_hidden for i in order]).to(self.device, self.dtype)
        model = self.model
        positions, ctx = self._step(spans, tables, block_tables)
        hidden = model(ids, positions, model.fc(aux), ctx)
        if k == 0:
            return [[] for _ in rows]
        ends = itertools.accumulate(len(s) for s in spans)
        hidden = hidden[self._tensor([e - 1 for e in ends], torch.int64)]
        first = model.to_target_ids(model.compute_logits(hidden).argmax(-1))
        lens = [s.stop for s in spans]
        drafts = chain_drafts(
            model,
            self.kv_cache,
            self.backend,
            self.block_size,
            first,
            hidden,
            self._tensor([n - 1 for n in lens], torch.int64),
            block_tables,
            k,
            max(lens) + k - 1,
            lens,
        )
        out = drafts.tolist()  # the one host sync
        result: list[list[int]] = [[] for _ in rows]
        for j, i in enumerate(order):
            result[i] = out[j]
        return result

    def _span(self, row: DraftRow, k: int) -> range:
        n = len(row.token_ids)
        if n < 1 or row.aux_hidden.shape[0] != n:
            raise ValueError(
                f"a draft row needs n >= 1 tokens and as many aux hidden rows, got {n} tokens "
                f"and {row.aux_hidden.shape[0]} rows"
            )
        last = row.start + n - 1 + max(k - 1, 0)  # the last position written
        if last >= len(row.block_ids) * self.block_size:
            raise ValueError(
                f"drafting {k} tokens from position {row.start + n - 1} writes position {last}, "
                f"past the row's {len(row.block_ids)} blocks"
            )
        return range(row.start, row.start + n)

    def _step(
        self, spans: list[range], tables: list[list[int]], block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, ForwardContext]:
        """Positions and attention metadata for one forward over `spans`, a range per row."""
        bs = self.block_size
        positions = [p for s in spans for p in s]
        slots = [t[p // bs] * bs + p % bs for s, t in zip(spans, tables, strict=True) for p in s]
        qsl = list(itertools.accumulate((len(s) for s in spans), initial=0))
        seq_lens = [s.stop for s in spans]
        md = AttentionMetadata(
            query_start_loc=self._tensor(qsl, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=block_tables,
            slot_mapping=self._tensor(slots, torch.int64),
            max_query_len=max(len(s) for s in spans),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            num_decodes=sum(len(s) == 1 for s in spans),
        )
        return self._tensor(positions, torch.int64), ForwardContext(md, self.kv_cache, self.backend)

    def _tensor(self, data: list[Any], dtype: torch.dtype) -> torch.Tensor:
        cuda = self.device.type == "cuda"
        return torch.tensor(data, dtype=dtype, pin_memory=cuda).to(self.device, non_blocking=cuda)
