"""Build a model from a Hugging Face-format directory: real safetensors weights, or dummy ones."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import torch
from torch import nn

from ember.models.checkpoint_files import safetensors_files
from ember.models.config import ModelConfig
from ember.models.fp8 import dequantize_fp8
from ember.models.registry import resolve_architecture
from ember.models.weight_staging import iter_safetensors, iter_staged

LOAD_FORMATS = ("auto", "safetensors", "dummy")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes, made where the parameters live (fast on a GPU)."""
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def load_model(
    model_dir: str | Path,
    config: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    max_position: int = 0,
) -> nn.Module:
    model_dir = Path(model_dir)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    config = config or ModelConfig.from_dir(model_dir)
    cls = resolve_architecture(config.architecture)
    dtype = dtype or config.dtype
    files = [] if load_format == "dummy" else safetensors_files(model_dir)
    with _default_dtype(dtype), torch.device(device):
        model = cls(config, max_position=max_position)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        # On a GPU the shards are read by several threads into pinned buffers and reach the
        # model as GPU tensors (weight_staging); elsewhere through safetensors' own reads.
        on_gpu = torch.device(device).type == "cuda"
        tensors = iter_staged(files, device) if on_gpu else iter_safetensors(files)
        # FP8 block-quantized checkpoints reach the model dequantized to its dtype.
        with closing(tensors):
            loaded = model.load_weights(dequantize_fp8(tensors, config.fp8_block_size, dtype))
        missing = sorted(set(dict(model.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"checkpoint in {str(model_dir)!r} lacks weights: {missing[:8]}")
    return model.eval()
