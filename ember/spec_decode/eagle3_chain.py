"""The chained steps of an EAGLE-3 head: from each row's first draft, K - 1 more, each one token a
row at the next position, its input the draft before it and the head's own last hidden state.

Every step is fixed-shape work on the device: positions, KV slots and context lengths follow from
the last position and the block tables by tensor arithmetic, with no host data in between. So the
chain can be captured in a CUDA graph for a batch size and replayed, or run eagerly as the same
launches (ember/spec_decode/eagle3.py's `propose`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from ember.attention.backend import AttentionBackend


class DraftHead(Protocol):
    """What the chain calls of a head (ember.spec_decode.eagle3.Eagle3DraftModel)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


def chain_drafts(
    head: DraftHead,
    kv_cache: torch.Tensor,
    backend: AttentionBackend,
    block_size: int,
    first: torch.Tensor,
    hidden: torch.Tensor,
    last_pos: torch.Tensor,
    block_tables: torch.Tensor,
    k: int,
    max_seq_len: int,
    host_lens: list[int] | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drafts [B, k] (target-vocabulary ids): `first` [B] and k - 1 chained steps.

    `hidden` [B, H] is the head's output at each row's last position `last_pos` [B] (int64), whose
    draft is `first`; step j writes the head's KV at last_pos + j through `block_tables` [B, W]
    (which must hold it). `max_seq_len` bounds the rows' contexts (the decode kernel's split
    count: a captured chain takes the engine's longest). `host_lens`: the rows' context lengths
    at their last position, for an attention backend that reads host lists (the CPU's); None
    where none is read (the Triton backend's decode rows, a captured chain). `valid` [B] bool:
    rows padding a captured batch are False and write no KV (slot -1; what they read and draft
    is thrown away)."""
    rows = first.shape[0]
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=first.device)
    drafts = [first]
    pos = last_pos
    for step in range(1, k):
        pos = pos + 1
        page = block_tables.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).to(torch.int64)
        slots = page * block_size + pos % block_size
        md = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=(pos + 1).to(torch.int32),
            block_tables=block_tables,
            slot_mapping=slots if valid is None else torch.where(valid, slots, -1),
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(rows + 1)),
            seq_lens_cpu=[n + step for n in host_lens] if host_lens else [max_seq_len] * rows,
            num_decodes=rows,
        )
        hidden = head(drafts[-1], pos, hidden, ForwardContext(md, kv_cache, backend))
        drafts.append(head.to_target_ids(head.compute_logits(hidden).argmax(-1)))
    return torch.stack(drafts, dim=1)
