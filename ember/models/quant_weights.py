"""A quantized checkpoint's tensors on their way into the model.

Layers the model keeps quantized get the checkpoint's tensors as they are (`weight_packed`,
`weight_scale`, `weight_zero_point`, `weight_shape`; FP8 `weight` and its scale, DeepSeek's
`weight_scale_inv` under the name `weight_scale`): the layer checks and places them
(ember/models/layers/quant_linear.py, quant_moe.py). A layer the model computes in its own dtype
although the checkpoint quantized it (MLA's `kv_b_proj`, whose weight attention splits per head)
gets its weight dequantized here, once all its tensors have come: a weight and its scales may
sit in different shards, in either order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from ember.kernels.quant_ref import dequantize_fp8, dequantize_int, unpack_int_rows
from ember.models.quant_config import QuantConfig, WeightQuant

QUANT_ATTRS = frozenset(
    {"weight_packed", "weight_scale", "weight_scale_inv", "weight_zero_point", "weight_shape"}
)
UNSUPPORTED_ATTRS = {
    "input_scale": "static activation scales",
    "weight_g_idx": "a permutation of the inputs (actorder 'group')",
    "weight_global_scale": "FP4 global scales",
    "input_global_scale": "FP4 global scales",
}


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.element_size() == 1


def quantized_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
    quant: QuantConfig | None,
    keeps_dense: Callable[[str], bool],
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model takes them. `keeps_dense(module)`: whether the
    model computes that checkpoint layer in `dtype` (its quantized tensors are then dequantized
    here)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, attr = name.rpartition(".")
        if attr in UNSUPPORTED_ATTRS:
            raise ValueError(
                f"checkpoint tensor {name!r}: {UNSUPPORTED_ATTRS[attr]} are not supported"
            )
        quantized = attr in QUANT_ATTRS or (attr == "weight" and is_fp8(tensor))
        if not quantized:
            yield name, tensor
            continue
        if quant is None:
            raise ValueError(
                f"checkpoint tensor {name!r} ({tensor.dtype}) is quantized, but config.json has "
                "no quantization_config"
            )
        scheme = quant.scheme_for(module)
        if scheme is None:
            raise ValueError(
                f"checkpoint tensor {name!r} is quantized, but quantization_config leaves "
                f"{module!r} unquantized"
            )
        if attr == scheme.scale_name and scheme.scale_name != "weight_scale":
            attr = "weight_scale"
        elif attr == "weight_scale_inv":
            raise ValueError(
                f"checkpoint tensor {name!r}: quantization_config's scheme for {module!r} names "
                "its scales 'weight_scale'"
            )
        if not keeps_dense(module):
            yield f"{module}.{attr}", tensor
            continue
        parts = pending.setdefault(module, {})
        parts[attr] = tensor
        if _complete(parts, scheme):
            del pending[module]
            yield f"{module}.weight", dequantize_layer(module, parts, scheme, dtype)
    if pending:
        module, parts = sorted(pending.items())[0]
        scheme = quant.scheme_for(module) if quant else None
        missing = sorted(set(scheme.tensor_names()) - parts.keys()) if scheme else []
        raise ValueError(
            f"quantized weight {module!r} lacks {', '.join(missing)} in the checkpoint "
            f"({len(pending)} layer(s) incomplete)"
        )


def _complete(parts: dict[str, torch.Tensor], scheme: WeightQuant) -> bool:
    return set(scheme.tensor_names()) <= parts.keys()


def dequantize_layer(
    module: str, parts: dict[str, torch.Tensor], scheme: WeightQuant, dtype: torch.dtype
) -> torch.Tensor:
    """One checkpoint layer's weight [N, K] in `dtype`, from its quantized tensors (checked
    against the scheme; the error names the layer)."""
    if scheme.kind == "fp8":
        weight, scale = parts["weight"], parts["weight_scale"].float()
        check_fp8(module, weight, scale, scheme)
        n, k = weight.shape
        if scheme.per_tensor:
            scale = scale.reshape(1, 1).expand(n, 1)
        return dequantize_fp8(weight, scale, scheme.block_for(k), dtype)
    n, k = weight_shape(module, parts["weight_shape"])
    group = scheme.group_for(k)
    zero = parts.get("weight_zero_point")
    check_int(module, parts["weight_packed"], parts["weight_scale"], zero, scheme, n, k)
    if zero is not None:
        zero = unpack_int_rows(zero, scheme.bits, n)
    return dequantize_int(
        parts["weight_packed"], parts["weight_scale"], zero, scheme.bits, group, k, dtype
    )


def weight_shape(module: str, shape: torch.Tensor) -> tuple[int, int]:
    if shape.numel() != 2 or shape.is_floating_point():
        raise ValueError(f"{module}.weight_shape must be two integers, got {shape.tolist()}")
    n, k = (int(v) for v in shape.tolist())
    return n, k


def check_int(
    module: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    scheme: WeightQuant,
    n: int,
    k: int,
) -> None:
    """A packed INT weight's tensors against its [n, k] shape and scheme."""
    group = scheme.group_for(k)
    if k % group:
        raise ValueError(f"{module}: group size {group} does not divide the weight's {k} inputs")
    per = 32 // scheme.bits
    expected = {
        "weight_packed": (packed, torch.int32, (n, -(-k // per))),
        "weight_scale": (scale, None, (n, k // group)),
    }
    if zero is not None:
        expected["weight_zero_point"] = (zero, torch.int32, (-(-n // per), k // group))
    for attr, (t, want_dtype, shape) in expected.items():
        if want_dtype is not None and t.dtype != want_dtype:
            raise ValueError(f"{module}.{attr} is {t.dtype}, expected {want_dtype}")
        if want_dtype is None and not t.is_floating_point():
            raise ValueError(f"{module}.{attr} is {t.dtype}, expected a float dtype")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{module}.{attr} has shape {tuple(t.shape)}; a [{n}, {k}] INT{scheme.bits} "
                f"weight ({scheme.describe()}) needs {shape}"
            )


def check_fp8(module: str, weight: torch.Tensor, scale: torch.Tensor, scheme: WeightQuant) -> None:
    """An FP8 weight and its scales against the scheme."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{module}.weight is {weight.dtype}, expected float8_e4m3fn")
    if weight.dim() != 2:
        raise ValueError(f"{module}.weight has shape {tuple(weight.shape)}, not a matrix")
    n, k = weight.shape
    if scheme.per_tensor:
        shape: tuple[int, ...] = (1,)
        ok = scale.numel() == 1
    else:
        rows, cols = scheme.block_for(k)
        shape = (-(-n // rows), -(-k // cols))
        ok = tuple(scale.shape) == shape or (cols == k and tuple(scale.shape) == (n,))
    if not ok:
        raise ValueError(
            f"{module}.{scheme.scale_name} has shape {tuple(scale.shape)}; weight of shape "
            f"{(n, k)} with {scheme.describe()} needs {shape}"
        )
