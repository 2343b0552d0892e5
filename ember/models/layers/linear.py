"""Linear layers: one row at a time through ember's GEMV, and layers that fuse several checkpoint
matrices into one matmul (q/k/v, gate/up).

Checkpoints store `q_proj`, `k_proj`, `v_proj` (and `gate_proj`, `up_proj`) separately; one fused
weight means one GEMM per step instead of three. `weight_loader` copies a named shard into place.

Tensor parallel: a layer is column parallel (each shard's output rows split across the ranks) or
row parallel (its inputs split, the outputs summed), as ember.models.layers.parallel says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import gemv
from ember.models.layers.activation import silu_and_mul
from ember.models.layers.parallel import Parallel, Range, RankSlice, finish_partial, rank_slice
from ember.models.layers.quant_linear import QuantLinear
from ember.models.quant_config import QuantConfig, WeightQuant


class Linear(nn.Linear):
    """nn.Linear whose single-row calls (batch-1 decode) on a large weight take
    ember/kernels/gemv.py on a GPU, where it beats cuBLAS (`gemv.usable` says when); every other
    call is F.linear.

    Built with the checkpoint's sizes, it holds this rank's `rank_slice` of the weight (all of
    it unless tensor parallel); a row-parallel slice's output is all-reduced (`finish_partial`).
    Its output rows are named parts (one, "", unless a `StackedLinear` fuses several)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        rank_slice: RankSlice | None = None,
    ) -> None:
        rs = rank_slice or RankSlice.whole("", in_features, {"": out_features})
        super().__init__(rs.local_in, sum(rs.sizes.values()), bias=bias)
        self.rank_slice = rs
        self.partial = rs.partial
        self.shard_sizes = rs.sizes
        """Each part's rows in this layer: the checkpoint's, or this rank's when column parallel."""
        self.shard_offsets: dict[str, int] = {}
        off = 0
        for name, size in self.shard_sizes.items():
            self.shard_offsets[name] = off
            off += size
        self.received: set[tuple[str, str]] = set()
        """(parameter, part) pairs `weight_loader` has filled: a load checks that none is
        missing (`StackedLinear.missing_shards`), as one fused weight stands for several
        checkpoint names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.partial:
            return self._partial_forward(x)
        if gemv.usable(x, self.weight, self.bias):
            return gemv.gemv(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def _partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Row parallel: this rank's inputs' share, summed over the ranks, the bias added once."""
        if gemv.usable(x, self.weight, None):
            y = gemv.gemv(x, self.weight)
        else:
            y = F.linear(x, self.weight)
        return finish_partial(y, self.bias, self.rank_slice)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str = "") -> None:
        """Copy this rank's slice of `loaded`, the checkpoint's whole tensor of part `shard`
        ("" for an unfused layer), into the part's rows of `param` (the weight or the bias)."""
        rs = self.rank_slice
        if shard not in self.shard_sizes:
            raise ValueError(f"{rs.name or 'the layer'} has no part {shard!r}")
        is_bias = param is self.bias
        rows = rs.part_rows[shard]
        expected = (rows,) if is_bias else (rows, rs.in_features)
        if tuple(loaded.shape) != expected:
            what = (rs.name or "the layer") + (f" part {shard!r}" if shard else "")
            raise ValueError(
                f"{what} has shape {tuple(loaded.shape)} in the checkpoint, expected {expected}"
            )
        off, size = self.shard_offsets[shard], self.shard_sizes[shard]
        with torch.no_grad():
            param.data[off : off + size].copy_(rs.take(loaded, shard, col_unit=1))
        self.received.add(("bias" if is_bias else "weight", shard))


class StackedLinear(Linear):
    """A Linear whose output rows are the concatenation of named shards (q/k/v, gate/up; this
    rank's rows of each when column parallel)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        rank_slice: RankSlice | None = None,
    ) -> None:
        rs = rank_slice or RankSlice.whole("", in_features, shard_sizes)
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, rank_slice=rs)

    def missing_shards(self, attr: str) -> list[str]:
        """The shards of parameter `attr` ("weight", "bias") no checkpoint tensor has filled."""
        return [s for s in self.shard_sizes if (attr, s) not in self.received]

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split(list(self.shard_sizes.values()), dim=-1))

    def activated(
        self, act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """act(self(x)) for the MLP's gated activation of this [gate | up] layer. One row through
        SiLU, on a weight the GEMV takes, has SiLU-and-mul in the GEMV's epilogue: the same bits,
        one launch fewer."""
        gate_up = list(self.shard_sizes.values())
        if (
            act is silu_and_mul
            and len(gate_up) == 2
            and gate_up[0] == gate_up[1]
            and gemv.usable(x, self.weight, self.bias)
        ):
            return gemv.gemv_silu(x, self.weight)
        return act(self(x))


def quant_scheme(quant: QuantConfig | None, names: list[str]) -> WeightQuant | None:
    """The scheme of the checkpoint layers `names` that one of ember's layers computes (None:
    unquantized)."""
    return quant.scheme_of_parts(names) if quant is not None else None


def make_linear(
    in_features: int,
    out_features: int | dict[str, int],
    quant: QuantConfig | None,
    name: str,
    parts: dict[str, str] | None = None,
    bias: bool = False,
    parallel: Parallel = None,
    rows: Range | dict[str, Range] | None = None,
    reduce: bool = True,
) -> nn.Module:
    """A linear layer as the checkpoint stores it: `Linear` (one int `out_features`) or
    `StackedLinear` (shards by name) in the model's dtype, or a `QuantLinear` if
    quantization_config quantizes it. `name`: the checkpoint's module name, or with `parts`
    (shard -> the checkpoint's name of that part) the fused layer's prefix.

    Sizes are the checkpoint's; `parallel`, `rows` and `reduce` say which slice this rank holds
    (ember.models.layers.parallel.rank_slice): "column" splits each shard's output rows (in equal
    slices, or as `rows` gives them: [start, end) of the checkpoint's rows, one range for an int
    `out_features`, one per shard for a dict), "row" splits the inputs and all-reduces the output
    unless `reduce` is False. On one rank the equal slices are the whole: the layer is the
    replicated one."""
    names = list(parts.values()) if parts else [name]
    scheme = quant_scheme(quant, names)
    shards = out_features if isinstance(out_features, dict) else {"": out_features}
    rs = rank_slice(in_features, shards, name, parallel, rows, reduce)
    if scheme is not None:
        return QuantLinear(in_features, shards, scheme, name, bias=bias, rank_slice=rs)
    if isinstance(out_features, dict):
        return StackedLinear(in_features, out_features, bias=bias, rank_slice=rs)
    return Linear(in_features, out_features, bias=bias, rank_slice=rs)
