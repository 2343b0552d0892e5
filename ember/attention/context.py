"""What a forward pass hands down through the model: the step's attention metadata, the KV cache
and the backend that reads and writes it. Its own module, so that the dependencies run one way:
context -> backend -> metadata (a backend takes metadata; metadata knows no backend)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    """Handed down through the model on each forward pass (explicitly, never as a global)."""

    metadata: AttentionMetadata
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    backend: AttentionBackend
    dp_rows: torch.Tensor | None = None
    """Data-parallel attention (ember/engine/dp_attention.py): the step's flat rows this rank
    attends to, its own requests' (int64); `metadata` then describes those rows alone. None:
    every row is this rank's."""
    dp_foreign: torch.Tensor | None = None
    """Data-parallel attention in a decode graph: which of the step's rows are not this rank's
    (bool); `metadata` makes them padding rows, and their outputs are zeroed."""
