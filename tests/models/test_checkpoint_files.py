"""ember.models.checkpoint_files: the read-ahead of a checkpoint's shards (every byte, in the
loader's order, up to its cap, stopping when asked) and what it does with what is not one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.models.checkpoint_files import available_memory, read_ahead, safetensors_files


def shards(d: Path, sizes: list[int]) -> list[Path]:
    files = []
    for i, n in enumerate(sizes):
        f = d / f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors"
        f.write_bytes(os.urandom(n))
        files.append(f)
    weight_map = {f"w{i}": f.name for i, f in enumerate(files)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


@pytest.mark.parametrize("advise", [True, False], ids=["fadvise", "plain-reads"])
def test_reads_every_byte_of_every_shard(tmp_path: Path, advise: bool, monkeypatch) -> None:
    """Through the kernel's read-ahead (posix_fadvise, then each piece's last byte), or read
    outright where there is no posix_fadvise."""
    if not advise:
        monkeypatch.delattr(os, "posix_fadvise")
    files = shards(tmp_path, [3000, 1, 70_000, 0, 5])
    state = read_ahead(tmp_path, limit=1 << 40, piece=4096)
    assert state is not None and state.thread is not None
    state.thread.join(10)
    assert state.read == state.total == sum(f.stat().st_size for f in files)
    assert state.error is None and state.summary().endswith(
        f"0.1 of 0.1 MB in {state.seconds:.1f} s, done"
    )
    assert safetensors_files(tmp_path) == files


def test_stops_at_its_cap(tmp_path: Path) -> None:
    shards(tmp_path, [10_000, 10_000])
    state = read_ahead(tmp_path, limit=12_345, piece=1000)
    assert state is not None and state.thread is not None
    state.thread.join(10)
    assert state.total == state.read == 12_345


def test_the_default_cap_is_half_the_available_memory(tmp_path: Path) -> None:
    shards(tmp_path, [4096])
    avail = available_memory()
    assert avail is None or avail > 0
    state = read_ahead(tmp_path)
    if avail is None:
        assert state is None
    else:
        assert state is not None and state.total == min(4096, avail // 2)
        assert state.thread is not None
        state.thread.join(10)


def test_stop_ends_it_early(tmp_path: Path) -> None:
    shards(tmp_path, [1 << 22])
    state = read_ahead(tmp_path, limit=1 << 40, piece=1)  # a byte a read: slow on purpose
    assert state is not None and state.thread is not None
    state.stop.set()
    state.thread.join(10)
    assert not state.thread.is_alive() and state.read < state.total


def test_nothing_to_read_is_no_read_ahead(tmp_path: Path) -> None:
    assert read_ahead(tmp_path / "missing") is None
    assert read_ahead(tmp_path) is None  # no safetensors
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert read_ahead(gguf) is None
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # no weight_map
    assert read_ahead(tmp_path) is None
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"w": "gone.safetensors"}}'
    )
    assert read_ahead(tmp_path) is None
    shards(tmp_path, [100])
    assert read_ahead(tmp_path, limit=0) is None


def test_a_shard_it_cannot_read_is_reported_not_raised(tmp_path: Path) -> None:
    """A read-ahead is a hint: a shard replaced mid-way by something unreadable ends it with
    the error kept for the log (the loader reads the files again and reports them)."""
    files = shards(tmp_path, [100_000, 1000])
    state = read_ahead(tmp_path, limit=1 << 40, piece=1)  # the first shard takes a while
    files[1].unlink()
    files[1].mkdir()
    assert state is not None and state.thread is not None
    state.thread.join(30)
    assert not state.thread.is_alive()
    assert state.error is not None and "stopped" in state.summary()
    assert state.read == 100_000


def test_the_module_imports_no_torch() -> None:
    """The engine process starts the read-ahead before it imports torch."""
    code = "import sys, ember.models.checkpoint_files; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("fmt", ["auto", "dummy"])
def test_the_core_process_entry_starts_it_unless_the_weights_are_dummy(
    tmp_path, fmt, monkeypatch
) -> None:
    import ember.engine.core_proc as core_proc
    from ember.engine import core_spawn
    from ember.engine.config import EngineConfig
    from ember.models import checkpoint_files

    shards(tmp_path, [1000])
    monkeypatch.setattr(checkpoint_files, "_started", None)
    seen = []
    monkeypatch.setattr(core_proc, "engine_core_main", lambda *a: seen.append(a))
    config = EngineConfig(model=str(tmp_path), device="cpu", load_format=fmt)
    core_spawn.engine_core_entry(config, "ipc://in", "ipc://out", 1)
    assert len(seen) == 1
    state = checkpoint_files.started()
    if fmt == "dummy":
        assert state is None
    else:
        assert state is not None and state.total == 1000
        state.thread.join(10)
