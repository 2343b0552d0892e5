"""Which part of a linear layer's checkpoint matrix this rank holds, for the tensor-parallel
layers of ember/models/layers/linear.py and quant_linear.py.

A column-parallel layer holds some of the output rows of each part (q, k, v or gate, up), so its
output is this rank's slice of the whole; a row-parallel layer holds a slice of the input columns,
so its output is a partial sum, which the ranks all-reduce. The layers are built with the
checkpoint's sizes and keep their rank's slice; `weight_loader` gets the checkpoint's whole tensor
and copies that slice, so the loader hands every rank the same tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ember.distributed import comm
from ember.distributed.shard import shard_range
from ember.distributed.state import current

Range = tuple[int, int]
"""[start, end) of a checkpoint dimension."""

Parallel = Literal["column", "row"] | None


@dataclass(frozen=True, slots=True)
class RankSlice:
    """This rank's part of a [sum of the parts' rows, in_features] checkpoint matrix.

    `name` is the checkpoint's module name (for errors). `rows[part]` is the part's checkpoint
    rows held here, of `part_rows[part]`; `cols` the input columns held, of `in_features`.
    `partial`: the output is this rank's partial sum (row parallel over several ranks), which
    `reduce` says the layer all-reduces itself (else its caller does, once, after adding other
    partial sums: MoE's routed and shared experts)."""

    name: str
    rows: dict[str, Range]
    part_rows: dict[str, int]
    cols: Range
    in_features: int
    partial: bool = False
    reduce: bool = True
    rank: int = 0

    @classmethod
    def whole(cls, name: str, in_features: int, parts: dict[str, int]) -> RankSlice:
        """All of the matrix (one rank, or a replicated layer)."""
        return cls(
            name, {p: (0, n) for p, n in parts.items()}, dict(parts), (0, in_features), in_features
        )

    @property
    def sizes(self) -> dict[str, int]:
        """The rows of each part held here."""
        return {p: end - start for p, (start, end) in self.rows.items()}

    @property
    def local_in(self) -> int:
        """The input columns held here."""
        return self.cols[1] - self.cols[0]

    @property
    def is_whole(self) -> bool:
        return self.cols == (0, self.in_features) and all(
            r == (0, self.part_rows[p]) for p, r in self.rows.items()
        )

    def take(
        self, loaded: torch.Tensor, part: str, row_unit: int = 1, col_unit: int = 0
    ) -> torch.Tensor:
        """This rank's slice of `loaded`, one part's whole checkpoint tensor: rows down dim 0 (a
        row of it covering `row_unit` of the part's rows) and, for a 2-D tensor with `col_unit`,
        input columns along dim 1 (a column covering `col_unit` inputs; 0: dim 1 is not split,
        as a per-row scale's). The layer has checked that the units are not cut."""
        start, end = self.rows[part]
        if (start, end) != (0, self.part_rows[part]):
            loaded = loaded[start // row_unit : -(-end // row_unit)]
        c0, c1 = self.cols
        if col_unit and loaded.dim() == 2 and (c0, c1) != (0, self.in_features):
            loaded = loaded[:, c0 // col_unit : -(-c1 // col_unit)]
        return loaded


def rank_slice(
    in_features: int,
    parts: dict[str, int],
    name: str,
    parallel: Parallel = None,
    rows: Range | dict[str, Range] | None = None,
    reduce: bool = True,
) -> RankSlice:
    """The slice of this rank (ember.distributed.state) of a layer with the checkpoint's
    `in_features` and rows `parts` (one unnamed part "" for an unfused layer).

    `parallel`: None (replicated), "column" (each part's rows split in equal contiguous slices,
    or as `rows` gives them: a range for an unfused layer, a range per part for a fused one, in
    the part's own row numbers) or "row" (the inputs split in equal contiguous slices; `reduce`
    False leaves the all-reduce to the caller). Sizes the ranks do not divide are refused,
    naming the layer."""
    s = current()
    whole = RankSlice.whole(name, in_features, parts)
    if parallel is None:
        if rows is not None:
            raise ValueError(f"{name}: explicit rows are for a column-parallel layer")
        return whole
    if parallel == "row":
        if rows is not None:
            raise ValueError(f"{name}: explicit rows are for a column-parallel layer")
        cols = shard_range(in_features, s.rank, s.size, f"{name}'s inputs")
        return RankSlice(
            name, whole.rows, whole.part_rows, cols, in_features, s.size > 1, reduce, s.rank
        )
    if parallel != "column":
        raise ValueError(f"{name}: parallel must be None, 'column' or 'row', not {parallel!r}")
    if rows is None:
        ranges = {
            p: shard_range(n, s.rank, s.size, f"{name}'s {p + ' ' if p else ''}rows")
            for p, n in parts.items()
        }
    else:
        ranges = rows if isinstance(rows, dict) else {"": rows}
        if set(ranges) != set(parts):
            raise ValueError(
                f"{name}: rows given for parts {sorted(ranges)}, it has {sorted(parts)}"
            )
        ranges = {p: ranges[p] for p in parts}
        for p, (start, end) in ranges.items():
            if not 0 <= start <= end <= parts[p]:
                raise ValueError(
                    f"{name}: rows [{start}, {end}) of part {p!r} outside its {parts[p]}"
                )
    return RankSlice(name, ranges, dict(parts), (0, in_features), in_features, rank=s.rank)


def finish_partial(y: torch.Tensor, bias: torch.Tensor | None, rs: RankSlice) -> torch.Tensor:
    """A row-parallel layer's partial sum `y` finished: summed over the ranks (in place) and the
    bias added once; or, where the caller sums, the bias added on rank 0 only."""
    if rs.reduce:
        comm.all_reduce(y)
    elif rs.rank != 0:
        return y
    return y if bias is None else y + bias
