"""An EAGLE-3 head's config.json (the published layout, see ember/spec_decode/eagle3.py): the draft
layer's shape, its vocabulary and the target states it reads, with the checks that refuse a
malformed checkpoint or a head trained for another target."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.models.config import ModelConfig, read_config_json

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, L // 2, L - 3), vLLM's and SpecForge's choice, as residual-stream indices (index i is
    the input of layer i: `DecoderModel.aux_layers`). Clamped into [0, L] for targets under 5
    layers, so the tiny test models (L = 2) get (2, 1, 0)."""
    low, mid, high = (min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))
    return low, mid, high


@dataclass(slots=True, frozen=True)
class Eagle3Config:
    layer: ModelConfig
    """The draft decoder layer's shape (hidden size, heads, rope, eps) and the target vocabulary."""
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None
    """The target states the head was trained on, when the checkpoint pins them."""
    norm_before_residual: bool
    """Some checkpoints (speculators) make the normed hidden state the residual, not the raw one."""

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> Eagle3Config:
        return cls.from_dict(read_config_json(draft_dir, "EAGLE-3 draft directory"))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Eagle3Config:
        archs = cfg.get("architectures") or []
        if not archs or archs[0] not in ARCHITECTURES:
            raise ValueError(
                f"draft config.json names architecture {archs[0] if archs else None!r}, not an "
                f"EAGLE-3 head (expected {' or '.join(ARCHITECTURES)})"
            )
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                "EAGLE-3 heads have one decoder layer; draft config.json has "
                f"num_hidden_layers={cfg['num_hidden_layers']}"
            )
        layer = ModelConfig.from_dict({**cfg, "num_hidden_layers": 1})
        draft_vocab = cfg.get("draft_vocab_size") or layer.vocab_size
        if not 1 <= draft_vocab <= layer.vocab_size:
            raise ValueError(
                f"draft_vocab_size {draft_vocab} must be in [1, vocab_size={layer.vocab_size}]"
            )
        eagle = cfg.get("eagle_config") or {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if aux is not None and (len(aux) != 3 or not all(isinstance(i, int) for i in aux)):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must be 3 layer ids, got {aux!r}")
        return cls(
            layer=layer,
            draft_vocab_size=draft_vocab,
            target_hidden_size=cfg.get("target_hidden_size") or layer.hidden_size,
            aux_layers=tuple(aux) if aux is not None else None,
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        )

    def aux_layers_for(self, target: ModelConfig) -> tuple[int, ...]:
        return self.aux_layers or default_aux_layers(target.num_hidden_layers)

    def check_target(self, target: ModelConfig, own_embedding: bool) -> None:
        """Refuse a head trained for another model, naming the field that disagrees."""
        if self.layer.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft vocab_size {self.layer.vocab_size} != target's {target.vocab_size}"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"draft target_hidden_size {self.target_hidden_size} != target's hidden_size "
                f"{target.hidden_size}"
            )
        if not own_embedding and self.layer.hidden_size != target.hidden_size:
            raise ValueError(
                f"draft hidden_size {self.layer.hidden_size} != target's {target.hidden_size}, and "
                "the checkpoint has no embed_tokens.weight of its own to read tokens with"
            )
        bad = [i for i in self.aux_layers_for(target) if not 0 <= i <= target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"aux hidden state layers {bad} are outside the target's "
                f"[0, {target.num_hidden_layers}]"
            )
