"""Linear layers whose weight stays quantized on the device: packed INT4 / INT8 with group scales
(W4A16, compressed-tensors `pack-quantized`) or FP8 with block, channel or tensor scales.

A layer holds the checkpoint's tensors in their published layout (ember/kernels/quant_ref.py says
it) and computes through the Triton kernels that dequantize in registers
(ember/kernels/int_gemm.py, fp8_gemm.py); on the CPU through the plain-PyTorch reference, which
dequantizes the weight first. Like StackedLinear it may fuse several checkpoint matrices (q/k/v,
gate/up) as row shards: INT rows are independent; FP8 blocks need every shard but the last to be
a whole number of block rows. Tensor parallel, it holds a rank's slice of the checkpoint's
tensors (ember/models/layers/parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ember.kernels.dispatch import use_triton
from ember.kernels.quant_ref import fp8_matmul_ref, int_matmul_ref, unpack_int_rows
from ember.models.layers.parallel import RankSlice, finish_partial
from ember.models.quant_config import WeightQuant
from ember.models.quant_weights import weight_shape

INT_DUMMY_SCALE = 0.02 / 4.6
"""A dummy INT weight's scale: uniform 4-bit values have a standard deviation of ~4.6, so its
weights come out near the 0.02 of ember's dense dummy weights."""


def quant_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """An empty parameter of a quantized layer (integer and FP8 ones take no gradient)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def init_dummy_quantized(
    quant: WeightQuant,
    values: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    gen: torch.Generator,
) -> None:
    """Random quantized weights of ember's dummy magnitude: `values` the packed words or FP8
    values ([N, K'], or stacked experts [E, N, K'], whose FP8 values are drawn one expert at a
    time so that no float copy of all of them is made), `scale` and `zero` their scales and
    zero points."""
    dev = gen.device
    with torch.no_grad():
        if quant.kind == "int":
            values.copy_(
                torch.randint(-(2**31), 2**31 - 1, values.shape, generator=gen, device=dev)
            )
            scale.fill_(INT_DUMMY_SCALE)
        else:
            for v in values if values.dim() == 3 else [values]:
                v.copy_(torch.randn(v.shape, generator=gen, device=dev).to(v.dtype))
            scale.fill_(0.02)
        if zero is not None:
            zero.zero_()


class QuantLinear(nn.Module):
    """y = x W.T (+ bias) with W [sum(shard_sizes), in_features] stored quantized as `quant`
    says. `name` (the checkpoint's module name) is for errors.

    Sizes are the checkpoint's; the layer holds this rank's `rank_slice` of them (all unless
    tensor parallel). Along the inputs a slice must keep whole INT groups, packed words and FP8
    scale blocks and activation groups (else it is refused, naming the weight); along the rows
    anything goes: INT zero points, packed down the rows, are unpacked before they are cut, and
    FP8 rows that start inside a scale block take per-row copies of its scale."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        quant: WeightQuant,
        name: str,
        bias: bool = False,
        rank_slice: RankSlice | None = None,
    ) -> None:
        super().__init__()
        rs = rank_slice or RankSlice.whole(name, in_features, shard_sizes)
        self.rank_slice = rs
        self.partial = rs.partial
        self.full_in = full_k = in_features
        self.in_features = k = rs.local_in
        self.shard_sizes = rs.sizes
        self.out_features = n = sum(self.shard_sizes.values())
        self.quant = quant
        self.name = name
        self.shard_offsets: dict[str, int] = {}
        off = 0
        for shard, size in self.shard_sizes.items():
            self.shard_offsets[shard] = off
            off += size
        self.received: set[tuple[str, str]] = set()
        dtype = torch.get_default_dtype()
        if quant.kind == "int":
            group = quant.group_for(full_k)
            if full_k % group:
                raise ValueError(f"{name}: group size {group} does not divide its {full_k} inputs")
            per = 32 // quant.bits
            self._check_cols("weight_packed", per, f"packed int32 words of {per} values")
            self.scale_cols = 0  # one scale a row: the inputs' split leaves it whole
            if quant.group_size:
                self._check_cols("weight_scale", group, f"groups of {group} inputs")
                self.scale_cols = group
            # A channel-wise scale covers this rank's inputs as it covered all of them.
            self.group_size = group = group if quant.group_size else k
            self.weight_packed = quant_param((n, -(-k // per)), torch.int32)
            self.weight_scale = quant_param((n, k // group), dtype)
            if not quant.symmetric:
                self.weight_zero_point = quant_param((n, k // group), torch.int8)
        else:
            self.ckpt_block = rows, cols = quant.block_for(full_k)
            self.scale_cols = 0 if quant.per_tensor or not quant.block[1] else cols
            if self.scale_cols:
                self._check_cols("weight_scale", cols, f"scale blocks of {cols} inputs")
            act = quant.act_group_for(full_k)
            if act and quant.act_group:
                self._check_cols("input", act, f"FP8 activation groups of {act}")
            sizes = list(self.shard_sizes.values())
            if any(size % rows for size in sizes[:-1]) or any(
                r0 % rows for r0, _ in rs.rows.values()
            ):
                # A part that ends inside a block row, or a rank's rows that start inside one:
                # its scales cannot be stacked with the next part's, or do not start at a block,
                # so every row gets its own copy of its block's scales.
                rows = 1
            self.block = (rows, cols if self.scale_cols else k)
            # Per-token activation scales (act_group 0) are taken over this rank's inputs: a
            # row-parallel rank sees no others, so they differ from one rank's in rounding.
            self.act_group = quant.act_group_for(k)
            self.weight = quant_param((n, k), torch.float8_e4m3fn)
            self.weight_scale = quant_param((-(-n // rows), -(-k // self.block[1])), torch.float32)
        self.bias = quant_param((n,), dtype) if bias else None

    def _check_cols(self, tensor: str, unit: int, what: str) -> None:
        """Refuse a slice of the inputs that cuts a quantization unit of `unit` inputs."""
        c0, c1 = self.rank_slice.cols
        if c0 % unit or (c1 % unit and c1 != self.full_in):
            raise ValueError(
                f"{self.name}.{tensor}: this rank's inputs [{c0}, {c1}) of {self.full_in} cut "
                f"its {what} ({self.quant.describe()}); a tensor-parallel size that leaves "
                f"each rank whole ones is needed"
            )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str = "") -> None:
        """`load` by parameter: this rank's slice of the checkpoint's whole tensor `loaded`."""
        attr = next(a for a, p in self._parameters.items() if p is param)
        self.load(attr, loaded, shard, f"{self.name}.{attr}")

    def load(self, attr: str, loaded: torch.Tensor, shard: str, source: str) -> str | None:
        """Place this rank's slice of checkpoint tensor `source` (this layer's `attr`, of part
        `shard`, whole); returns the parameter it filled (None for `weight_shape`, which is only
        checked)."""
        if shard not in self.shard_sizes:
            raise ValueError(f"{source}: {self.name} has no part {shard!r}")
        if attr == "bias" and self.bias is not None:
            self._rows(self.bias, loaded, shard, source)
            self.received.add(("bias", shard))
            return "bias"
        if attr not in self.quant.tensor_names():
            raise ValueError(
                f"checkpoint tensor {source!r}: {self.name} is quantized ({self.quant.describe()}) "
                f"and holds {', '.join(self.quant.tensor_names())}, not {attr!r}"
            )
        self.received.add((attr, shard))
        size, k = self.rank_slice.part_rows[shard], self.full_in
        if attr == "weight_shape":
            if weight_shape(source, loaded) != (size, k):
                raise ValueError(
                    f"{source} says {weight_shape(source, loaded)}; the model's layer is "
                    f"{(size, k)}"
                )
            return None
        param = getattr(self, attr)
        if attr == "weight_zero_point":
            per = 32 // self.quant.bits
            expected = (-(-size // per), k // self.quant.group_for(k))
            if loaded.dtype != torch.int32 or tuple(loaded.shape) != expected:
                raise ValueError(
                    f"{source} is {loaded.dtype} {tuple(loaded.shape)}, expected int32 {expected} "
                    f"(zero points packed down the rows)"
                )
            loaded = unpack_int_rows(loaded, self.quant.bits, size)
        elif attr == "weight_scale" and self.quant.kind == "fp8":
            return self._fp8_scale(loaded, shard, source)
        elif loaded.dtype != param.dtype and not (
            attr == "weight_scale" and loaded.is_floating_point()
        ):
            raise ValueError(f"{source} is {loaded.dtype}, expected {param.dtype}")
        self._rows(param, loaded, shard, source)
        return attr

    def _col_unit(self, param: torch.Tensor) -> int:
        """Inputs a column of `param` covers in the checkpoint (0: one column a row)."""
        if param is self.bias:
            return 0
        if param is getattr(self, "weight_packed", None):
            return 32 // self.quant.bits
        if param is getattr(self, "weight", None):
            return 1
        return self.scale_cols  # INT scales and zero points

    def _rows(self, param: torch.Tensor, loaded: torch.Tensor, shard: str, source: str) -> None:
        """Copy this rank's slice of `loaded` (the checkpoint's whole tensor of part `shard`)
        into the part's rows of `param`."""
        full = self.rank_slice.part_rows[shard]
        unit = self._col_unit(param)
        cols = self._full_cols(param, unit)
        expected = (full, *([cols] if param.dim() == 2 else []))
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"{source} has shape {tuple(loaded.shape)}, expected {expected} "
                f"({self.quant.describe()})"
            )
        off, size = self.shard_offsets[shard], self.shard_sizes[shard]
        with torch.no_grad():
            param.data[off : off + size].copy_(self.rank_slice.take(loaded, shard, col_unit=unit))

    def _full_cols(self, param: torch.Tensor, unit: int) -> int:
        """The checkpoint's columns of `param`'s tensor."""
        if param.dim() != 2 or not unit:
            return param.shape[-1]
        return -(-self.full_in // unit)

    def _fp8_scale(self, loaded: torch.Tensor, shard: str, source: str) -> str:
        rows, cols = self.ckpt_block
        rs = self.rank_slice
        full = rs.part_rows[shard]
        if self.quant.per_tensor:  # one scale, stored down the part's rows
            if loaded.numel() != 1:
                raise ValueError(f"{source} has shape {tuple(loaded.shape)}, expected one scale")
            loaded = loaded.reshape(1, 1).expand(full, 1)
        elif cols == self.full_in and loaded.dim() == 1:
            loaded = loaded[:, None]  # per-channel scales saved as a vector
        expected = (-(-full // rows), -(-self.full_in // cols))
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"{source} has shape {tuple(loaded.shape)}; {full} x {self.full_in} in "
                f"{rows}x{cols} blocks needs {expected}"
            )
        loaded = rs.take(loaded, shard, row_unit=rows, col_unit=self.scale_cols)
        off, size = self.shard_offsets[shard], self.shard_sizes[shard]
        if self.block[0] != rows:  # scales per row (the constructor says why)
            skip = rs.rows[shard][0] % rows  # the rank's first row within its first block
            loaded = loaded.repeat_interleave(rows, 0)[skip : skip + size]
        rows = self.block[0]
        first, count = off // rows, -(-size // rows)
        with torch.no_grad():
            self.weight_scale.data[first : first + count].copy_(loaded)
        return "weight_scale"

    def missing_shards(self, attr: str) -> list[str]:
        if attr == "weight_scale" or attr in self.quant.tensor_names() or attr == "bias":
            return [s for s in self.shard_sizes if (attr, s) not in self.received]
        return []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        q = self.quant
        if q.kind == "int":
            zero = getattr(self, "weight_zero_point", None)
            args = (x2, self.weight_packed, self.weight_scale, zero, q.bits, self.group_size)
            if use_triton(x):
                from ember.kernels.int_gemm import int_matmul

                y = int_matmul(*args)
            else:
                y = int_matmul_ref(*args)
        else:
            args8 = (x2, self.weight, self.weight_scale, self.block, self.act_group)
            if use_triton(x):
                from ember.kernels.fp8_gemm import fp8_matmul

                y = fp8_matmul(*args8)
            else:
                y = fp8_matmul_ref(*args8)
        if self.partial:
            y = finish_partial(y, self.bias, self.rank_slice)
        elif self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        return list(out.split(list(self.shard_sizes.values()), dim=-1))

    def activated(
        self, act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        return act(self(x))

    def init_dummy(self, gen: torch.Generator) -> None:
        """Random weights of ember's dummy magnitude (`--load-format dummy`)."""
        values = self.weight_packed if self.quant.kind == "int" else self.weight
        init_dummy_quantized(
            self.quant, values, self.weight_scale, getattr(self, "weight_zero_point", None), gen
        )
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()
