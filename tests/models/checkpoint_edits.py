"""A tiny checkpoint copied with one weight left out: what a start or a load must refuse."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file


def copy_without(src: Path, dst: Path, weight: str) -> Path:
    """`src` (a one-shard model directory) copied into `dst` without `weight`; returns `dst`."""
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    (shard,) = src.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors[weight]
    save_file(tensors, dst / shard.name)
    return dst
