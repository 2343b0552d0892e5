"""Linear layers: one row at a time through ember's GEMV, and layers that fuse several checkpoint
matrices into one matmul (q/k/v, gate/up).

Checkpoints store `q_proj`, `k_proj`, `v_proj` (and `gate_proj`, `up_proj`) separately; one fused
weight means one GEMM per step instead of three. `weight_loader` copies a named shard into place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import gemv
from ember.models.layers.activation import silu_and_mul
from ember.models.layers.quant_linear import QuantLinear
from ember.models.quant_config import QuantConfig, WeightQuant


class Linear(nn.Linear):
    """nn.Linear whose single-row calls (batch-1 decode) on a large weight take
    ember/kernels/gemv.py on a GPU, where it beats cuBLAS (`gemv.usable` says when); every other
    call is F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv.usable(x, self.weight, self.bias):
            return gemv.gemv(x, self.weight)
        return F.linear(x, self.weight, self.bias)


class StackedLinear(Linear):
    """An nn.Linear whose output rows are the concatenation of named shards."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_sizes = dict(shard_sizes)
        self.received: set[tuple[str, str]] = set()
        """(parameter, shard) pairs `weight_loader` has filled: a load checks that none is
        missing (`missing_shards`), as one fused weight stands for several checkpoint names."""
        self.shard_offsets: dict[str, int] = {}
        off = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = off
            off += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        off, size = self.shard_offsets[shard], self.shard_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(
                f"shard {shard!r} has {loaded.shape[0]} rows in the checkpoint, expected {size}"
            )
        with torch.no_grad():
            param.data[off : off + size].copy_(loaded)
        self.received.add(("bias" if param is self.bias else "weight", shard))

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
) -> nn.Module:
    """A linear layer as the checkpoint stores it: `Linear` (one int `out_features`) or
    `StackedLinear` (shards by name) in the model's dtype, or a `QuantLinear` if
    quantization_config quantizes it. `name`: the checkpoint's module name, or with `parts`
    (shard -> the checkpoint's name of that part) the fused layer's prefix."""
    names = list(parts.values()) if parts else [name]
    scheme = quant_scheme(quant, names)
    if scheme is not None:
        shards = out_features if isinstance(out_features, dict) else {"": out_features}
        return QuantLinear(in_features, shards, scheme, name, bias=bias)
    if isinstance(out_features, dict):
        return StackedLinear(in_features, out_features, bias=bias)
    return Linear(in_features, out_features, bias=bias)
