"""What one forward pass tells every attention layer: where each sequence's queries and KV live.

The batch is flat (varlen): sequence i owns query rows query_start_loc[i]:query_start_loc[i+1], and
its KV context after this step is seq_lens[i] tokens long, laid in the blocks of block_tables[i].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so reference code and the CPU path never sync on the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int = 0
    """The first `num_decodes` sequences have one query token each (the decode kernel's rows)."""
    decode_groups: torch.Tensor | None = None
    """[num_decodes] int: decode rows taken in groups (a verification's k + 1 positions of one
    request, consecutive rows over the same blocks): the rows each row leads, 0 for a led row
    (`ember.kernels.decode_attention`). None: every row on its own."""
    max_decode_group: int = 1

    def to(self, device: str | torch.device) -> AttentionMetadata:
        """The same metadata with its tensors on `device` (the host copies stay as they are)."""
        return replace(
            self,
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            slot_mapping=self.slot_mapping.to(device),
            decode_groups=None if self.decode_groups is None else self.decode_groups.to(device),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
