"""Mixture-of-experts layers whose experts stay quantized on the device: packed INT4 / INT8 with
group scales (Kimi K2.5's routed experts) or FP8 blocks (Kimi K2, DeepSeek-V3).

The experts are stacked as FusedMoE stacks them (w13 = gate rows then up rows, w2 = down), each
tensor in the checkpoint's layout with an expert dimension in front: INT `w13_packed`
[E, 2I, H * bits / 32], `w13_scale` [E, 2I, H / group] (`w13_zero_point` int8, unpacked, if
asymmetric), FP8 `w13` [E, 2I, H] with `w13_scale` [E, 2I / rows, H / cols], and the same for
w2. On a GPU the fused grouped GEMM reads them (ember/kernels/fused_moe.py); on the CPU the
per-expert loop runs on weights dequantized as it goes (the reference).

On a tensor-parallel engine the experts split as FusedMoE's do. By expert, a rank keeps its
experts' tensors whole. By width, every tensor is cut along the intermediate dim: w13's gate and
up rows (packed words, group scales, unpacked zero points and FP8 weights alike; FP8 scales by
their block rows, or one a row where I / size does not fill whole blocks), w2's columns (packed
words, scale groups, FP8 blocks). A cut inside a packed word, an INT group or an FP8 block of
w2's is refused when the layer is built, naming the checkpoint tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels.dispatch import use_triton
from ember.kernels.quant_ref import (
    dequantize_int,
    fp8_matmul_ref,
    pack_int,
    unpack_int,
    unpack_int_rows,
)
from ember.models.layers.moe import FusedMoE
from ember.models.layers.quant_linear import init_dummy_quantized, quant_param
from ember.models.quant_config import WeightQuant
from ember.models.quant_weights import weight_shape

_SUFFIX = {
    "weight": "",
    "weight_packed": "_packed",
    "weight_scale": "_scale",
    "weight_zero_point": "_zero_point",
}


class QuantFusedMoE(FusedMoE):
    """FusedMoE with quantized experts (`quant`); `name` (the checkpoint's experts prefix) is
    for errors."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        quant: WeightQuant,
        name: str,
        act: str = "silu",
        num_shared: int = 0,
    ) -> None:
        self.quant, self.name = quant, name
        super().__init__(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            renormalize,
            act,
            num_shared,
        )

    def make_weights(self, total: int, hidden: int, inter: int) -> None:
        q, dtype = self.quant, torch.get_default_dtype()
        if inter < self.intermediate_size:
            self._check_width_cut(inter)
        # (rows, inputs) of w13 and w2
        for w, (rows, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            if q.kind == "int":
                group = q.group_for(k)
                if k % group:
                    raise ValueError(
                        f"{self.name}: group size {group} does not divide the experts' {k} inputs"
                    )
                setattr(
                    self,
                    f"{w}_packed",
                    quant_param((total, rows, -(-k // (32 // q.bits))), torch.int32),
                )
                setattr(self, f"{w}_scale", quant_param((total, rows, k // group), dtype))
                if not q.symmetric:
                    setattr(
                        self, f"{w}_zero_point", quant_param((total, rows, k // group), torch.int8)
                    )
            else:
                bn, bk = q.block_for(k)
                if w == "w13" and inter % bn:
                    # Gate rows that end inside a block row: the gate's and up's scales cannot
                    # be stacked, so every row gets its own copy of its block's scales.
                    bn = 1
                setattr(self, w, quant_param((total, rows, k), torch.float8_e4m3fn))
                setattr(
                    self,
                    f"{w}_scale",
                    quant_param((total, -(-rows // bn), -(-k // bk)), torch.float32),
                )
        self.group_size = q.group_for(hidden) if q.kind == "int" else 0
        self.down_group = q.group_for(inter) if q.kind == "int" else 0
        if q.kind == "fp8":
            self.block13, self.block2 = q.block_for(hidden), q.block_for(inter)
            if inter % self.block13[0]:
                self.block13 = (1, self.block13[1])
            self.act13, self.act2 = q.act_group_for(hidden), q.act_group_for(inter)

    def _check_width_cut(self, inter: int) -> None:
        """Refuse a width split that cuts w2's packed words, INT groups or FP8 blocks (a rank's
        `inter` columns of the intermediate dim, w2's K, from column rank * inter)."""
        q, full = self.quant, self.intermediate_size
        if q.kind == "int":
            word, group = 32 // q.bits, q.group_size or 0
            if group > word:
                unit, what, tensor = group, f"groups of {group}", "weight_scale"
            else:
                unit, what, tensor = word, f"packed words ({word} values)", "weight_packed"
        else:
            unit, what, tensor = q.block[1], f"{q.block[0]}x{q.block[1]} blocks", "weight_scale"
        if unit and inter % unit:
            raise ValueError(
                f"{self.name}.*.down_proj.{tensor}: a tensor-parallel rank holds {inter} of the "
                f"experts' {full} intermediate columns, which cuts its {what}; use a size whose "
                f"share of {full} is a multiple of {unit}, or expert parallel"
            )

    def _width_cut(self, attr: str, t: torch.Tensor, part: str) -> torch.Tensor:
        """The rank's width of one expert's tensor `attr` as `_checked` returns it (the whole
        checkpoint expert): gate / up rows, or down's columns, of the intermediate dim."""
        a, b = self.width.start, self.width.stop
        if b - a == self.intermediate_size:
            return t
        q = self.quant
        if part != "down":  # rows: one a weight row, but FP8 scales one a block row
            per = self.block13[0] if q.kind == "fp8" and attr == "weight_scale" else 1
            return t[a // per : b // per]
        if attr == "weight_packed":
            per = 32 // q.bits
        elif attr == "weight":
            per = 1
        elif (q.group_size if q.kind == "int" else q.block[1]) == 0:
            return t  # channel-wise scales: one a row, the same for every column
        else:
            per = self.down_group if q.kind == "int" else self.block2[1]
        return t[:, a // per : b // per]

    def load(self, attr: str, loaded: torch.Tensor, shard: str, source: str) -> str | None:
        """Place checkpoint tensor `source` (the whole tensor): `attr` of part `shard` ('E.gate'
        | 'E.up' | 'E.down' | 'shared.gate' | ...). Returns the parameter filled (None for
        weight_shape and for another rank's expert)."""
        expert, part = shard.split(".")
        w = "w2" if part == "down" else "w13"
        i, h, e = self.intermediate_size, self.hidden_size, self.num_experts
        shared = expert == "shared"
        s = self.num_shared if shared else 1
        rows, k = (h, s * i) if part == "down" else (s * i, h)
        if attr == "weight_shape":
            if weight_shape(source, loaded) != (rows, k):
                raise ValueError(
                    f"{source} says {weight_shape(source, loaded)}; the model's is {(rows, k)}"
                )
            return None
        if attr not in self.quant.tensor_names():
            raise ValueError(
                f"checkpoint tensor {source!r}: {self.name} is quantized "
                f"({self.quant.describe()}) and holds {', '.join(self.quant.tensor_names())}, not {attr!r}"
            )
        if shared:
            first = len(self.local_experts)
        elif int(expert) >= e:
            raise ValueError(f"{source}: expert {expert} of a layer of {e} experts")
        elif (x := self.local_index(int(expert))) is None:
            return None  # another rank's
        else:
            first = x
        self.received.add(f"{shard}:{attr}")
        loaded = self._checked(attr, loaded, rows, k, source, part)
        name = f"{w}{_SUFFIX[attr]}"
        param = getattr(self, name)
        pieces = self._shared_pieces(attr, loaded, part) if shared else [loaded]
        with torch.no_grad():
            for j, piece in enumerate(pieces):
                piece = self._width_cut(attr, piece, part)
                dst = param.data[first + j]
                if part in ("gate", "up"):
                    dst = self._half(dst, part, attr)
                if tuple(piece.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"{source} has shape {tuple(piece.shape)}, expected {tuple(dst.shape)} "
                        f"({self.quant.describe()})"
                    )
                dst.copy_(piece)
        return name

    def _half(self, dst: torch.Tensor, part: str, attr: str) -> torch.Tensor:
        """w13's gate or up rows of one expert's tensor `attr`."""
        rows = dst.shape[0] // 2
        return dst[:rows] if part == "gate" else dst[rows:]

    def _checked(
        self, attr: str, t: torch.Tensor, rows: int, k: int, source: str, part: str
    ) -> torch.Tensor:
        q = self.quant
        if attr == "weight_zero_point":
            if t.dtype != torch.int32:
                raise ValueError(f"{source} is {t.dtype}, expected int32 (packed zero points)")
            return unpack_int_rows(t, q.bits, rows)
        if attr == "weight_packed" and t.dtype != torch.int32:
            raise ValueError(f"{source} is {t.dtype}, expected int32")
        if attr == "weight" and t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{source} is {t.dtype}, expected float8_e4m3fn")
        if attr == "weight_scale" and not t.is_floating_point():
            raise ValueError(f"{source} is {t.dtype}, expected a float dtype")
        if attr == "weight_scale" and q.kind == "fp8" and q.per_tensor:
            if t.numel() != 1:
                raise ValueError(f"{source} has shape {tuple(t.shape)}, expected one scale")
            raise ValueError(
                f"{source}: per-tensor FP8 experts are not supported (block or channel scales)"
            )
        if attr == "weight_scale" and q.kind == "fp8" and t.dim() == 1:
            t = t[:, None]  # per-channel scales saved as a vector
        if attr == "weight_scale" and q.kind == "fp8":
            bn = q.block_for(k)[0]
            expected = (-(-rows // bn), -(-k // q.block_for(k)[1]))
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{source} has shape {tuple(t.shape)}; {rows} x {k} in "
                    f"{bn}x{q.block_for(k)[1]} blocks needs {expected}"
                )
            if part != "down" and self.block13[0] != bn:  # gate/up scales per row
                t = t.repeat_interleave(bn, 0)[:rows]
        return t

    def _shared_pieces(self, attr: str, t: torch.Tensor, part: str) -> list[torch.Tensor]:
        """The shared MLP's tensor split into its num_shared experts (rows of gate and up,
        columns of down)."""
        s, i = self.num_shared, self.intermediate_size
        if s == 1:
            return [t]
        q = self.quant
        if part != "down":
            if q.kind == "fp8" and i % q.block_for(self.hidden_size)[0]:
                raise ValueError(f"{self.name}: shared experts do not split into FP8 blocks")
            return list(t.split(t.shape[0] // s, dim=0))
        if attr == "weight_packed":
            values = unpack_int(t, q.bits, s * i)
            return [pack_int(v, q.bits) for v in values.split(i, dim=1)]
        if attr in ("weight_scale", "weight_zero_point") and q.kind == "int":
            return list(t.split(i // self.down_group, dim=1))
        if attr == "weight":
            return list(t.split(i, dim=1))
        bk = q.block_for(i)[1]
        if i % bk:
            raise ValueError(f"{self.name}: shared experts do not split into FP8 blocks")
        return list(t.split(i // bk, dim=1))

    def missing_shards(self, attr: str) -> list[str]:
        w = attr.split("_")[0]
        parts = ("gate", "up") if w == "w13" else ("down",)
        ours = {v: k for k, v in _SUFFIX.items()}
        ckpt_attr = ours.get(attr[len(w) :], "weight")
        names = [f"{x}.{p}" for x in self.local_experts for p in parts]
        if self.num_shared:
            names += [f"shared.{p}" for p in parts]
        return [n for n in names if f"{n}:{ckpt_attr}" not in self.received]

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        q = self.quant
        foreign = self.expert_map is not None
        if foreign:
            experts = self.to_local(experts)
        if use_triton(x):
            if q.kind == "int":
                from ember.kernels.fused_moe import fused_moe_int

                return fused_moe_int(
                    x,
                    self.w13_packed,
                    self.w13_scale,
                    getattr(self, "w13_zero_point", None),
                    self.w2_packed,
                    self.w2_scale,
                    getattr(self, "w2_zero_point", None),
                    weights,
                    experts,
                    q.bits,
                    self.group_size,
                    foreign=foreign,
                )
            from ember.kernels.fused_moe import fused_moe_fp8

            # The checkpoint's block: w13's scales one a row (`block13`) are recognised by shape.
            return fused_moe_fp8(
                x,
                self.w13,
                self.w13_scale,
                self.w2,
                self.w2_scale,
                weights,
                experts,
                q.block_for(self.hidden_size),
                foreign=foreign,
            )
        return self._reference(x, weights, experts)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts alone (every token to each with weight 1)."""
        t, e, s = x.shape[0], len(self.local_experts), self.num_shared
        experts = torch.arange(e, e + s, device=x.device).expand(t, s)
        return self.routed(x, x.new_ones(t, s, dtype=torch.float32), experts)

    def _expert_matmul(self, x: torch.Tensor, w: str, e: int) -> torch.Tensor:
        q = self.quant
        if q.kind == "int":
            k = x.shape[-1]
            group = self.group_size if w == "w13" else self.down_group
            zero = getattr(self, f"{w}_zero_point", None)
            weight = dequantize_int(
                getattr(self, f"{w}_packed")[e],
                getattr(self, f"{w}_scale")[e],
                zero[e] if zero is not None else None,
                q.bits,
                group,
                k,
                x.dtype,
            )
            return F.linear(x, weight)
        block, act = (self.block13, self.act13) if w == "w13" else (self.block2, self.act2)
        return fp8_matmul_ref(x, getattr(self, w)[e], getattr(self, f"{w}_scale")[e], block, act)

    def _reference(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The per-expert loop, each expert's weights dequantized as it runs (eager only)."""
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            if e >= len(self.local_experts) + self.num_shared:  # another rank's
                continue
            token_idx, slot = torch.where(experts == e)
            h = self.act(self._expert_matmul(x[token_idx], "w13", e))
            h = self._expert_matmul(h, "w2", e) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h)
        return out

    def init_dummy(self, gen: torch.Generator) -> None:
        """Random experts of ember's dummy magnitude (`--load-format dummy`)."""
        for w in ("w13", "w2"):
            values = getattr(self, f"{w}_packed" if self.quant.kind == "int" else w)
            zero = getattr(self, f"{w}_zero_point", None)
            init_dummy_quantized(self.quant, values, getattr(self, f"{w}_scale"), zero, gen)


def make_fused_moe(
    num_experts: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    renormalize: bool,
    act: str,
    quant: WeightQuant | None,
    name: str,
    num_shared: int = 0,
) -> FusedMoE:
    """The experts of an MoE layer as the checkpoint stores them: FusedMoE in the model's dtype,
    or QuantFusedMoE if quantization_config quantizes them."""
    if quant is None:
        return FusedMoE(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            renormalize,
            act,
            num_shared,
        )
    return QuantFusedMoE(
        num_experts,
        top_k,
        hidden_size,
        intermediate_size,
        renormalize,
        quant,
        name,
        act,
        num_shared,
    )
