"""BlockLayout with MLA's one-plane latent cache: bytes, the layout read off a cache tensor, and
fingerprints (a K/V layout keeps the one it had before planes were a field)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ember.kv.tiers import BlockLayout


def test_a_latent_cache_has_one_plane() -> None:
    cache = torch.zeros(3, 4, 1, 16, 1, 40, dtype=torch.bfloat16)
    layout = BlockLayout.from_kv_cache(cache, "m")
    assert layout.kv_planes == 1
    assert layout.nbytes == cache[0].numel() * 2 == 4 * 16 * 40 * 2
    kv = BlockLayout.from_kv_cache(torch.zeros(3, 4, 2, 16, 2, 8), "m")
    assert kv.kv_planes == 2 and kv.nbytes == 4 * 2 * 16 * 2 * 8 * 4
    assert layout.fingerprint() != BlockLayout(4, 1, 40, 16, "bfloat16", "m", 2).fingerprint()
    with pytest.raises(ValueError, match="block-major"):
        BlockLayout.from_kv_cache(torch.zeros(3, 4, 3, 16, 1, 8), "m")
    with pytest.raises(ValueError, match="kv_planes"):
        BlockLayout(4, 1, 40, 16, "bfloat16", "m", 3)


def test_a_kv_layouts_fingerprint_is_unchanged() -> None:
    """The fingerprint text of a K/V layout is the one written before kv_planes existed."""
    layout = BlockLayout(2, 2, 8, 16, "float32", "model")
    text = "num_layers=2|num_kv_heads=2|head_dim=8|block_size=16|dtype=float32|model=model"
    assert layout.fingerprint() == hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
