"""The seam between the model and its attention implementation (plain PyTorch or GPU kernels).

KV cache layout, one tensor for the whole model:
    [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
(MLA models keep one latent vector a token instead: planes 1, heads 1, ModelConfig.kv_cache_dims)
Block-major, so one block's KV for every layer is a single contiguous region: moving a block to
another engine or storage tier is one copy. A layer sees the strided view `kv_cache[:, layer]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ember.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    fuses_kv_write: bool = False
    """The rotation may write this step's K and V into the cache itself (one launch fewer a
    layer); the layer then calls forward with kv_written=True."""
    takes_mla: bool = False
    """Multi-head latent attention layers call `mla` rather than ember/attention/mla.py's
    `mla_attention` (a backend that splits a forward pass into graphs takes the call:
    ember/engine/piecewise_graphs.py); every other backend runs ember's MLA as it is."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        out: torch.Tensor | None = None,  # [T, num_heads, head_dim]: where to write, else new
    ) -> torch.Tensor:  # [T, num_heads, head_dim]: `out` when given
        """Write this step's K and V into the cache (unless `kv_written`: the rotation did),
        then attend causally over each context."""

    def mla(
        self,
        q_nope: torch.Tensor,  # [T, num_heads, qk_nope_head_dim]
        q_rope: torch.Tensor,  # [T, num_heads, qk_rope_head_dim], rotated
        latent: torch.Tensor,  # [T, kv_lora_rank + qk_rope_head_dim]: this step's latent rows
        w_uk: torch.Tensor,  # [num_heads, qk_nope_head_dim, kv_lora_rank]
        w_uv: torch.Tensor,  # [num_heads, v_head_dim, kv_lora_rank]
        cache: torch.Tensor,  # one layer's latent cache [num_blocks, 1, block_size, 1, L + R]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, v_head_dim]
        """Multi-head latent attention, where `takes_mla`: as `mla_attention` does it."""
        raise NotImplementedError(f"the {self.name} backend does not take MLA calls")
