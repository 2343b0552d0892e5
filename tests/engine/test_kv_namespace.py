"""Block hashes name the model by what it computes, not where it lies: the same checkpoint at two
paths (or on two nodes) gives the same root hash, so KV tiers shared across engines and the
router's prefix index agree; another config, other weights or another dtype give another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.kv_tiers import model_fingerprint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def copy_of(model: Path, dest: Path) -> Path:
    shutil.copytree(model, dest)
    return dest


def test_fingerprint_follows_the_files_not_the_path(llama: Path, tmp_path: Path) -> None:
    same = copy_of(llama, tmp_path / "elsewhere")
    assert model_fingerprint(same, "auto", CPU) == model_fingerprint(llama, "auto", CPU)

    config = copy_of(llama, tmp_path / "config")
    cfg = json.loads((config / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 2
    (config / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(config, "auto", CPU) != model_fingerprint(llama, "auto", CPU)

    weights = copy_of(llama, tmp_path / "weights")
    with (weights / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 8)  # other weights: the file's size differs
    assert model_fingerprint(weights, "auto", CPU) != model_fingerprint(llama, "auto", CPU)

    # Dummy weights are not the checkpoint's: they name their own.
    assert model_fingerprint(llama, "dummy", CPU) != model_fingerprint(llama, "auto", CPU)


def core(model: Path, **kwargs: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), max_model_len=64, num_kv_blocks=8, **kwargs))


def test_engines_of_one_model_at_two_paths_share_the_root_hash(llama: Path, tmp_path: Path) -> None:
    here, there = core(llama), core(copy_of(llama, tmp_path / "node2"))
    assert here.kv.root == there.kv.root
    assert core(llama, dtype="bfloat16").kv.root != here.kv.root
    assert core(llama, block_size=8).kv.root != here.kv.root
