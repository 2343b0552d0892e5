"""Data-parallel attention: a rank's share of a step.

With `--enable-dp-attention` the ranks of a multi-head latent attention model split the
requests, not the heads: each request lives on one rank, whose latent cache alone holds its KV
(one latent vector a token serves every head, so splitting by heads would copy the whole cache
onto every rank). The engine's block ids are one space cut into equal runs, rank r holding ids
[r * B, (r + 1) * B) in its own cache of B blocks (ember/kv/data_parallel.py), so a request's
block table names its rank, and the step plan every rank gets needs nothing more.

Every rank still runs every token of the step through the embedding, the norms and the MLP
(tensor or expert parallel, as without). Its attention layers take its own requests' rows
(`own_rows`), attend over its own cache with metadata of those rows alone, and the ranks sum
their outputs, each in its own rows of a zeroed [tokens, hidden] (ember/models/deepseek_v3.py),
into the whole step's.

A decode graph's rows are fixed in number, so there a rank attends to every row: its own in its
block ids, the others' as padding rows that write nowhere and read one harmless slot, and zeroes
the others' outputs before the sum (`localize`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.engine.step_plan import EagerInputs


@dataclass(frozen=True, slots=True)
class DataParallelShare:
    """Which blocks, and so which requests, are this rank's."""

    rank: int
    blocks_per_rank: int
    block_size: int

    def owner(self, block_table: list[int]) -> int:
        """The rank a request's blocks, and so its attention, live on."""
        return block_table[0] // self.blocks_per_rank

    def own_rows(self, e: EagerInputs) -> tuple[EagerInputs, list[int]]:
        """This rank's requests of a step: their attention metadata in this rank's block ids
        (the input ids and positions left empty: the model takes the whole step's), and their
        rows in the step's flat layout. Requests keep the step's order (decodes first)."""
        first_block = self.rank * self.blocks_per_rank
        first_slot = first_block * self.block_size
        rows: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        num_decodes = 0
        max_query_len = 0
        for j, table in enumerate(e.block_tables):
            if self.owner(table) != self.rank:
                continue
            start, end = e.query_start_loc[j], e.query_start_loc[j + 1]
            rows.extend(range(start, end))
            slots.extend(s - first_slot for s in e.slots[start:end])
            qsl.append(qsl[-1] + end - start)
            seq_lens.append(e.seq_lens[j])
            tables.append([b - first_block for b in table])
            num_decodes += j < e.num_decodes
            max_query_len = max(max_query_len, end - start)
        own = EagerInputs(
            input_ids=[],
            positions=[],
            slots=slots,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=max_query_len,
            num_decodes=num_decodes,
        )
        return own, rows

    def localize(
        self, rows: np.ndarray, tables: np.ndarray, used: int, size: int, width: int
    ) -> np.ndarray:
        """Turn a decode graph's staged step (ember/engine/cuda_graphs.fill_rows: `rows` [6, N]
        and `tables` [N, W], `used` of `size` rows real, the tables' first `width` columns in
        use) into this rank's, in place: its own
        requests' slots and tables in its block ids, every other row a padding row (slot -1,
        context 1, block 0, a row group of its own). Returns which rows are not this rank's
        (bool [size]), whose attention outputs the model zeroes."""
        first_block = self.rank * self.blocks_per_rank
        own = np.zeros(size, dtype=bool)
        own[:used] = tables[:used, 0] // self.blocks_per_rank == self.rank
        mine = own[:used]
        slots, lens, groups = rows[2, :used], rows[3, :used], rows[5, :used]
        slots[:] = np.where(mine, slots - first_block * self.block_size, -1)
        lens[:] = np.where(mine, lens, 1)
        groups[:] = np.where(mine, groups, 1)
        t = tables[:used, :width]
        inside = (t >= first_block) & (t < first_block + self.blocks_per_rank)
        t[:] = np.where(mine[:, None] & inside, t - first_block, 0)
        return ~own
