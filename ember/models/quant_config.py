"""A checkpoint's `quantization_config`, read as published: which linear layers are quantized and
how (`WeightQuant`), or a clear error naming what ember cannot serve.

Two formats:

- **compressed-tensors** (`quant_method: "compressed-tensors"`, Kimi K2.5, llm-compressor's
  output): `config_groups`, each with `targets` (a class name such as "Linear", a module name, or
  "re:" + a regex matched at the start of the name) and its `weights` / `input_activations`
  arguments; `ignore` lists modules left in the model's dtype. ember reads `pack-quantized` INT4 /
  INT8 weights (group or channel scales, symmetric or with zero points, no activation
  quantization) and `float-quantized` FP8 weights (tensor, channel or block scales) with dynamic
  FP8 activations per token or per group, or none.
- **fp8** (`quant_method: "fp8"`, DeepSeek-V3 and Kimi K2 as published): every linear layer but
  the LM head and `modules_to_not_convert` is FP8 with one `weight_scale_inv` per block.

Module names are the checkpoint's (`model.layers.0.self_attn.q_proj`): ember's fused layers
look up each of their parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

INT_BITS = (4, 8)


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """How one linear layer's weight is stored and computed.

    kind "int": packed INT of `bits`, one scale per `group_size` inputs (0: per output channel),
    with zero points unless `symmetric`; activations stay in the model's dtype (W4A16 / W8A16).
    kind "fp8": float8_e4m3fn with one float32 scale per `block` (rows, cols) of the weight
    (0 cols: the whole input, i.e. per channel; "tensor": one scale, stored per channel);
    activations quantized to FP8 per `act_group` inputs of a token (0 cols: per token;
    None: not quantized, weight-only FP8)."""

    kind: Literal["int", "fp8"]
    bits: int = 8
    group_size: int = 0
    symmetric: bool = True
    block: tuple[int, int] = (1, 0)
    per_tensor: bool = False
    act_group: int | None = None
    scale_name: str = "weight_scale"
    """The checkpoint's name of the scale tensor (DeepSeek's FP8: `weight_scale_inv`)."""

    def group_for(self, in_features: int) -> int:
        """Inputs per INT scale for a layer of `in_features` inputs."""
        return self.group_size or in_features

    def block_for(self, in_features: int) -> tuple[int, int]:
        """The FP8 scale's (rows, cols) block for a layer of `in_features` inputs."""
        return self.block[0], self.block[1] or in_features

    def act_group_for(self, in_features: int) -> int:
        """Inputs per FP8 activation scale (0: activations not quantized)."""
        if self.act_group is None:
            return 0
        return self.act_group or in_features

    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors of one layer stored under this scheme (its own name for the
        scale: DeepSeek's `weight_scale_inv` reaches the layers as `weight_scale`)."""
        if self.kind == "fp8":
            return ("weight", "weight_scale")
        zero = () if self.symmetric else ("weight_zero_point",)
        return ("weight_packed", "weight_scale", "weight_shape", *zero)

    def describe(self) -> str:
        if self.kind == "int":
            group = f"group {self.group_size}" if self.group_size else "per channel"
            zero = "symmetric" if self.symmetric else "zero points"
            return f"INT{self.bits} weights ({group}, {zero}), 16-bit activations"
        if self.per_tensor:
            scales = "per tensor"
        elif self.block[0] == 1 and not self.block[1]:
            scales = "per channel"
        else:
            scales = f"{self.block[0]}x{self.block[1]} blocks"
        if self.act_group is None:
            acts = "16-bit activations"
        elif self.act_group:
            acts = f"FP8 activations per {self.act_group}-group"
        else:
            acts = "FP8 activations per token"
        return f"FP8 weights ({scales}), {acts}"


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """The schemes of a checkpoint: `(targets, scheme)` groups in order, and what is ignored."""

    method: str
    groups: tuple[tuple[tuple[str, ...], WeightQuant], ...]
    ignore: tuple[str, ...] = ()
    quantize_lm_head: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def scheme_for(self, name: str) -> WeightQuant | None:
        """The scheme of the linear layer the checkpoint calls `name`, or None if it is
        stored unquantized."""
        if any(_matches(name, target) for target in self.ignore):
            return None
        if name == "lm_head" and not self.quantize_lm_head:
            return None
        for targets, scheme in self.groups:
            if any(_matches(name, target) for target in targets):
                return scheme
        return None

    def scheme_of_parts(self, names: list[str]) -> WeightQuant | None:
        """The one scheme of the checkpoint layers `names` that ember fuses into one layer
        (q/k/v, gate/up, an MoE layer's experts): an error if they differ."""
        schemes = {name: self.scheme_for(name) for name in names}
        if len(set(schemes.values())) > 1:
            parts = ", ".join(
                f"{n}: {s.describe() if s else 'unquantized'}" for n, s in schemes.items()
            )
            raise ValueError(
                f"quantization_config quantizes the parts of one fused layer differently ({parts}); "
                "ember computes them as one matrix and needs one scheme"
            )
        return schemes[names[0]]

    def describe(self) -> str:
        """One line for the start-up log."""
        schemes = "; ".join(
            f"{scheme.describe()} on {', '.join(targets)}" for targets, scheme in self.groups
        )
        ignored = f"; unquantized: {', '.join(self.ignore)}" if self.ignore else ""
        return f"{self.method}: {schemes}{ignored}"


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' matching: "re:" + a regex matched at the name's start, the class
    name "Linear" (every layer ember asks about is one), or the exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or target == name


def parse_quant_config(quant: Any) -> QuantConfig | None:
    """config.json's `quantization_config` (None: an unquantized checkpoint)."""
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method == "fp8":
        return _parse_fp8(quant)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(quant)
    raise ValueError(
        f"unsupported quantization_config quant_method {method!r}; ember loads "
        "'compressed-tensors' (pack-quantized INT4/INT8, float-quantized FP8), 'fp8' (DeepSeek-V3 "
        "and Kimi K2's blocks) and unquantized checkpoints"
    )


def _parse_fp8(quant: dict[str, Any]) -> QuantConfig:
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported fp8 fmt {quant['fmt']!r}; only 'e4m3' is supported")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"unsupported fp8 activation_scheme {quant['activation_scheme']!r}; only 'dynamic'"
        )
    block = quant.get("weight_block_size")
    if block is None:
        raise ValueError(
            "fp8 quantization_config has no weight_block_size: per-tensor FP8 scales are not "
            "supported in this format, only block scales (weight_scale_inv)"
        )
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(_positive_int(b) for b in block)
    ):
        raise ValueError(
            f"unsupported fp8 weight_block_size {block!r}; expected two positive integers "
            "such as [128, 128]"
        )
    scheme = WeightQuant(
        kind="fp8", block=(block[0], block[1]), act_group=block[1], scale_name="weight_scale_inv"
    )
    unconverted = [
        *(quant.get("modules_to_not_convert") or ()),
        *(quant.get("ignored_layers") or ()),
    ]
    # Modules left out are named by a part of their name ("lm_head", "gate").
    ignore = tuple(f"re:.*{re.escape(m)}$" for m in unconverted if isinstance(m, str))
    return QuantConfig("fp8", ((("Linear",), scheme),), ignore, raw=quant)


_FORMATS = ("pack-quantized", "float-quantized")


def _parse_compressed_tensors(quant: dict[str, Any]) -> QuantConfig:
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(
            f"compressed-tensors quantization_status {status!r}: ember reads compressed "
            "checkpoints (the weights as packed or FP8 tensors), not ones saved mid-calibration"
        )
    for key, what in (
        ("kv_cache_scheme", "KV-cache quantization"),
        ("sparsity_config", "sparse weights"),
        ("transform_config", "weight transforms"),
    ):
        if quant.get(key):
            raise ValueError(f"compressed-tensors {key} is set: {what} is not supported")
    top_format = quant.get("format")
    groups_cfg = quant.get("config_groups")
    if not isinstance(groups_cfg, dict) or not groups_cfg:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    groups = []
    for group_name, group in groups_cfg.items():
        where = f"compressed-tensors config_groups.{group_name}"
        if not isinstance(group, dict):
            raise ValueError(f"{where} must be an object")
        fmt = group.get("format") or top_format
        if fmt not in _FORMATS:
            raise ValueError(
                f"{where}: format {fmt!r} is not supported; ember reads {' and '.join(_FORMATS)}"
            )
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"{where}.targets must be a list of names, got {targets!r}")
        if group.get("output_activations"):
            raise ValueError(f"{where}: output activation quantization is not supported")
        scheme = _ct_scheme(where, fmt, group.get("weights"), group.get("input_activations"))
        groups.append((tuple(targets), scheme))
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise ValueError(f"compressed-tensors ignore must be a list of names, got {ignore!r}")
    lm_head = any(
        any(_matches("lm_head", t) and t != "Linear" for t in targets) for targets, _ in groups
    )
    return QuantConfig("compressed-tensors", tuple(groups), tuple(ignore), lm_head, raw=quant)


def _ct_scheme(where: str, fmt: str, weights: Any, acts: Any) -> WeightQuant:
    if not isinstance(weights, dict):
        raise ValueError(f"{where} has no weights arguments")
    w = where + ".weights"
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    strategy, symmetric = weights.get("strategy"), weights.get("symmetric", True)
    if weights.get("dynamic"):
        raise ValueError(f"{w}: dynamic weight quantization is not supported")
    if weights.get("actorder") == "group":
        raise ValueError(f"{w}: actorder 'group' (a permutation of the inputs) is not supported")
    if fmt == "pack-quantized":
        if kind != "int" or bits not in INT_BITS:
            raise ValueError(
                f"{w}: pack-quantized {kind} of {bits} bits is not supported; ember reads INT4 "
                "and INT8"
            )
        if acts is not None:
            raise ValueError(
                f"{where}: pack-quantized with input_activations (W{bits}A{acts.get('num_bits')}) "
                "is not supported; ember computes packed INT weights with 16-bit activations"
            )
        if strategy == "group":
            group = weights.get("group_size")
            if not _positive_int(group):
                raise ValueError(f"{w}: group strategy needs a positive group_size, got {group!r}")
        elif strategy == "channel":
            group = 0
        else:
            raise ValueError(
                f"{w}: pack-quantized strategy {strategy!r} is not supported (group, channel)"
            )
        return WeightQuant(kind="int", bits=bits, group_size=group, symmetric=bool(symmetric))
    # float-quantized
    if kind != "float" or bits != 8:
        raise ValueError(f"{w}: float-quantized {kind} of {bits} bits is not supported (FP8)")
    if not symmetric:
        raise ValueError(f"{w}: asymmetric FP8 weights are not supported")
    per_tensor = False
    if strategy == "tensor":
        block, per_tensor = (1, 0), True
    elif strategy == "channel":
        block = (1, 0)
    elif strategy == "block":
        structure = weights.get("block_structure")
        if (
            not isinstance(structure, list | tuple)
            or len(structure) != 2
            or not all(_positive_int(b) for b in structure)
        ):
            raise ValueError(
                f"{w}: block strategy needs block_structure [rows, cols], got {structure!r}"
            )
        block = (structure[0], structure[1])
    else:
        raise ValueError(
            f"{w}: float-quantized strategy {strategy!r} is not supported (tensor, channel, block)"
        )
    return WeightQuant(
        kind="fp8", block=block, per_tensor=per_tensor, act_group=_fp8_activations(where, acts)
    )


def _fp8_activations(where: str, acts: Any) -> int | None:
    """The FP8 activation group (0: per token) of a group's input_activations; None: none."""
    if acts is None:
        return None
    a = where + ".input_activations"
    if not isinstance(acts, dict):
        raise ValueError(f"{a} must be an object")
    if acts.get("type", "float") != "float" or acts.get("num_bits") != 8:
        raise ValueError(
            f"{a}: {acts.get('type')} activations of {acts.get('num_bits')} bits are not "
            "supported with FP8 weights (FP8 activations)"
        )
    if not acts.get("dynamic"):
        raise ValueError(
            f"{a}: static activation scales (input_scale) are not supported; ember quantizes "
            "activations dynamically"
        )
    if not acts.get("symmetric", True):
        raise ValueError(f"{a}: asymmetric activations are not supported")
    strategy = acts.get("strategy")
    if strategy == "token":
        return 0
    if strategy == "group":
        group = acts.get("group_size")
        if not _positive_int(group):
            raise ValueError(f"{a}: group strategy needs a positive group_size, got {group!r}")
        return group
    raise ValueError(f"{a}: dynamic strategy {strategy!r} is not supported (token, group)")


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
