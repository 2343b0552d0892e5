"""The parts of a Hugging Face `config.json` that ember's models read, parsed and checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.models.quant_config import QuantConfig, parse_quant_config

if TYPE_CHECKING:
    import torch

# Names, not torch's dtypes: this module is imported on `ember serve`'s way to spawning its engine
# core, which must not wait for torch's import (ember/engine/core_spawn.py).
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def read_config_json(directory: str | Path, what: str) -> dict[str, Any]:
    """`directory`/config.json, parsed; FileNotFoundError naming `what` the directory is."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {what} {str(directory)!r}")
    return json.loads(path.read_text())


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
"""`kv_cache_dtype` settings other than "auto" (the model's dtype), as torch names the dtype the
cache is stored in. FP8 E4M3 with a per-tensor scale of 1 (vLLM's default for an uncalibrated
checkpoint): K, V and MLA's latents are rounded to 3 bits of mantissa and saturate at +-448,
which their magnitudes (normed latents, rotated keys) stay well inside."""


def kv_dtype_name(value: str, model_dtype: str) -> str:
    """The torch dtype name of a KV cache stored as `value` ("auto": `model_dtype`, "fp8")."""
    if value == "auto":
        return model_dtype
    try:
        return KV_CACHE_DTYPES[value]
    except KeyError:
        raise ValueError(
            f"unsupported kv_cache_dtype {value!r}; use one of auto, {', '.join(KV_CACHE_DTYPES)}"
        ) from None


def dtype_name(value: str | torch.dtype | None, default: str = "float32") -> str:
    """A dtype ("bf16", "torch.float16", torch.bfloat16, ...) as one of float32, float16 or
    bfloat16; `default` for None or "auto". Checked without torch: the API process parses
    configs too and imports no torch."""
    if value is None or value == "auto":
        return default
    try:
        return _DTYPES[str(value).removeprefix("torch.")]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {value!r}; use one of float32, float16, bfloat16"
        ) from None


def parse_dtype(value: str | torch.dtype | None, default: torch.dtype | None = None) -> torch.dtype:
    """A dtype from its name ("bf16", "torch.float16", ...) or itself; `default` (float32 when
    None) for None or "auto"."""
    import torch

    if value is None or value == "auto":
        return torch.float32 if default is None else default
    if isinstance(value, torch.dtype):
        return value
    if str(value) in DTYPE_BYTES:
        return getattr(torch, str(value))  # (a KV cache's float8_e4m3fn among them)
    return getattr(torch, dtype_name(value))


def kv_cache_shape(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    layers: int | None = None,
    tp_size: int | None = None,
) -> tuple[int, ...]:
    """[num_blocks, layers, planes, block_size, heads, dim]: block-major
    (`cfg.rank_kv_cache_dims`), one rank's of a tensor-parallel engine of `tp_size` (None: this
    process's, ember.distributed.state); `layers`: all of the model's by default."""
    if tp_size is None:
        from ember.distributed.state import current  # (the engine's side: torch is in)

        tp_size = current().size
    planes, heads, dim = cfg.rank_kv_cache_dims(tp_size)
    layers = cfg.num_hidden_layers if layers is None else layers
    return (num_blocks, layers, planes, block_size, heads, dim)


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    dtype_name: str
    """The checkpoint's dtype (`dtype_name`): float32, float16 or bfloat16; `dtype` is torch's."""
    # Mixture of experts (Qwen3-MoE); zero experts means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # DeepSeek-V3 / Kimi K2: multi-head latent attention (kv_lora_rank > 0) and grouped routing.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    # quantization_config: which linear layers are quantized and how; None if none is.
    quant: QuantConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's torch dtype (imports torch: the engine's side only)."""
        return parse_dtype(self.dtype_name)

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions rotary embeddings turn: a whole head, or with MLA the rope part only."""
        return self.qk_rope_head_dim if self.uses_mla else self.head_dim

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(planes, heads, dim) of one token's KV in one layer of the paged cache: K and V of
        each KV head (2, num_key_value_heads, head_dim), or with MLA one latent vector, the
        compressed KV and the shared rope key (1, 1, kv_lora_rank + qk_rope_head_dim)."""
        if self.uses_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_key_value_heads, self.head_dim

    def rank_kv_cache_dims(self, tp_size: int) -> tuple[int, int, int]:
        """`kv_cache_dims` of one rank of `tp_size`: its share of the KV heads (one, replicated,
        where the ranks outnumber them: ember.distributed.shard.shard_heads). MLA's latent vector
        has no heads to split: every rank keeps it whole."""
        planes, heads, dim = self.kv_cache_dims
        if self.uses_mla or tp_size == 1:
            return planes, heads, dim
        return planes, max(1, heads // tp_size), dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(model_dir, "model directory"))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no architecture ('architectures' is missing)")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"config.json lacks required field {key!r}")
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "")
        # transformers 5 nests rope settings in `rope_parameters`; older files use top-level keys.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "yarn"):
                raise ValueError(
                    f"unsupported rope scaling type {kind!r} (supported: llama3, yarn)"
                )
            needed = ("factor", "original_max_position_embeddings")
            lacking = [k for k in needed if scaling is not None and k not in scaling]
            if lacking:
                raise ValueError(f"rope scaling {kind!r} lacks {', '.join(lacking)}")
        return cls(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and says so nowhere in its config.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=cfg.get("hidden_act", "silu"),
            dtype_name=dtype_name(cfg.get("dtype") or cfg.get("torch_dtype")),
            num_experts=cfg.get("num_experts") or cfg.get("n_routed_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            # DeepSeek-V3: the first `first_k_dense_replace` layers are dense.
            mlp_only_layers=list(
                cfg.get("mlp_only_layers") or range(cfg.get("first_k_dense_replace") or 0)
            ),
            **_deepseek_fields(cfg),
            quant=parse_quant_config(cfg.get("quantization_config")),
            raw=cfg,
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def _deepseek_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MLA and routing fields of a DeepSeek-V3 / Kimi K2 config (none for other models)."""
    if not cfg.get("kv_lora_rank"):
        return {}
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise ValueError(f"an MLA config (kv_lora_rank set) needs {key!r}")
    if (cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1)")
    return {
        "q_lora_rank": cfg.get("q_lora_rank") or None,
        "kv_lora_rank": cfg["kv_lora_rank"],
        "qk_nope_head_dim": cfg["qk_nope_head_dim"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"],
        "v_head_dim": cfg["v_head_dim"],
        "n_group": cfg.get("n_group") or 1,
        "topk_group": cfg.get("topk_group") or 1,
        "n_shared_experts": cfg.get("n_shared_experts") or 0,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
    }
