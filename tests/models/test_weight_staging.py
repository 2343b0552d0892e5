"""ember.models.weight_staging: safetensors shards read by threads into staging buffers, against
the safetensors library's own reads of the same files; hostile headers; a load stopped early."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ember.models.weight_staging import iter_staged, plan_chunks, read_header


def library(files: list[Path]) -> dict[str, torch.Tensor]:
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118
                out[name] = fh.get_tensor(name)
    return out


def random_shards(d: Path, seed: int) -> list[Path]:
    g = torch.Generator().manual_seed(seed)
    shards = [
        {
            "embed.weight": torch.randn(97, 33, generator=g).to(torch.bfloat16),
            "norm.weight": torch.randn(33, generator=g),
            "scalar": torch.tensor(3.5, dtype=torch.float16),
            "empty": torch.empty(0, 4),
            "ids": torch.randint(-(2**40), 2**40, (5, 3), generator=g),
            "mask": torch.rand(7, generator=g) > 0.5,
        },
        {
            "fp8.weight": torch.randn(16, 8, generator=g).to(torch.float8_e4m3fn),
            "fp8.weight_scale_inv": torch.rand(1, 1, generator=g),
            "big": torch.randn(300, 50, generator=g).to(torch.float16),
            "bytes": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        },
    ]
    files = []
    for i, shard in enumerate(shards):
        f = d / f"model-{i}.safetensors"
        save_file(shard, str(f))
        files.append(f)
    return files


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4096, 1 << 26], ids=lambda b: f"chunk{b}")
@pytest.mark.parametrize("threads", [1, 3])
def test_every_tensor_matches_the_librarys_read(tmp_path: Path, chunk_bytes, threads) -> None:
    """Chunks from one piece a tensor to whole files, tensors larger than a buffer (split into
    pieces), zero-size and scalar tensors, 1-byte types: the same names, dtypes, shapes and
    bytes as safe_open gives, in file order."""
    files = random_shards(tmp_path, seed=chunk_bytes + threads)
    got = list(iter_staged(files, "cpu", threads=threads, chunk_bytes=chunk_bytes))
    want = library(files)
    assert sorted(n for n, _ in got) == sorted(want)
    for name, t in got:
        w = want[name]
        assert (t.dtype, t.shape) == (w.dtype, w.shape), name
        assert torch.equal(as_bytes(t), as_bytes(w)), name
    # File order: each file's tensors by their offsets.
    order = [e.name for f in files for e in read_header(f)]
    assert [n for n, _ in got] == order


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def hand_built(path: Path, header: dict, data: bytes, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def test_a_tensor_at_an_offset_not_a_multiple_of_its_size_is_copied_aligned(tmp_path: Path) -> None:
    """The format lets a 3-byte tensor put the next float32 at offset 3; a view there cannot be
    a float32 view, so that tensor is copied (same values)."""
    vals = torch.tensor([1.5, -2.25], dtype=torch.float32)
    data = bytes([7, 8, 9]) + vals.numpy().tobytes()
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
    }
    f = hand_built(tmp_path / "odd.safetensors", header, data)
    got = dict(iter_staged([f], "cpu"))
    assert got["a"].tolist() == [7, 8, 9]
    assert torch.equal(got["b"], vals)


def test_a_file_with_an_unlisted_dtype_goes_through_the_library(tmp_path: Path) -> None:
    files = random_shards(tmp_path, seed=5)
    odd = tmp_path / "complex.safetensors"
    save_file({"c": torch.randn(4, 2, dtype=torch.complex64)}, str(odd))
    assert read_header(odd) is None
    files.insert(1, odd)
    got = dict(iter_staged(files, "cpu", threads=2, chunk_bytes=512))
    want = library(files)
    assert got.keys() == want.keys()
    assert torch.equal(got["c"], want["c"])


@pytest.mark.parametrize(
    "header, data, length, match",
    [
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            1 << 40,
            "header length",
        ),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            b"\0" * 8,
            None,
            "data section",
        ),
        (
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "data section",
        ),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "shape"),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
            b"\0" * 8,
            None,
            "data section",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", 8]}},
            b"\0" * 8,
            None,
            "offsets",
        ),
        ({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "malformed"),
        ({"a": [1, 2]}, b"", None, "malformed"),
    ],
    ids=[
        "length",
        "past-end",
        "size-vs-shape",
        "negative-dim",
        "reversed",
        "string-offset",
        "no-offsets",
        "not-object",
    ],
)
def test_malformed_headers_are_refused_with_the_files_name(
    tmp_path: Path, header, data, length, match
) -> None:
    f = hand_built(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(ValueError, match=match) as e:
        list(iter_staged([f], "cpu"))
    assert "bad.safetensors" in str(e.value)


def test_not_json_and_too_short_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "junk.safetensors"
    f.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ValueError, match="not JSON"):
        read_header(f)
    f.write_bytes(b"abc")
    with pytest.raises(ValueError, match="shorter"):
        read_header(f)


def test_chunks_are_runs_of_adjacent_tensors_up_to_the_size(tmp_path: Path) -> None:
    files = random_shards(tmp_path, seed=1)
    entries = read_header(files[0])
    for size in (1, 100, 1000, 1 << 20):
        chunks = plan_chunks(entries, size)
        assert [e for c in chunks for e in c.entries] == entries
        for c in chunks:
            assert c.start == c.entries[0].start and c.end == c.entries[-1].end
            assert len(c.entries) == 1 or c.end - c.start <= size


def test_a_load_stopped_early_returns_at_once_and_reads_on_from_a_new_start(tmp_path: Path) -> None:
    """Readers waiting for a buffer (many pieces, few buffers) are woken when the consumer
    stops (the load failed on a bad weight): closing returns, no thread is left behind."""
    files = random_shards(tmp_path, seed=2)
    before = {t.name for t in threading.enumerate()}
    it = iter_staged(files, "cpu", threads=2, chunk_bytes=64)
    next(it)
    closer = threading.Thread(target=it.close)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive(), "closing the reader hung"
    left = {t.name for t in threading.enumerate()} - before
    assert not any(n.startswith("weights-read") for n in left), left
    assert len(list(iter_staged(files, "cpu", threads=2, chunk_bytes=64))) == 10


def test_a_file_cut_short_after_its_header_was_read_fails_cleanly(tmp_path: Path) -> None:
    files = random_shards(tmp_path, seed=3)
    it = iter_staged(files, "cpu", threads=2, chunk_bytes=64)
    next(it)  # the headers are read; a few pieces of the first file are read ahead
    with files[1].open("r+b") as fh:
        fh.truncate(files[1].stat().st_size - 100)
    with pytest.raises(ValueError, match="ended"):
        list(it)


def test_many_small_pieces_with_many_readers_never_stall(tmp_path: Path) -> None:
    """Pieces take buffers in order (a later piece holding the last free buffer while the one
    the consumer waits for cannot get one would hang): hundreds of pieces, 8 readers."""
    g = torch.Generator().manual_seed(9)
    f = tmp_path / "many.safetensors"
    tensors = {
        f"t{i:03d}": torch.randn(int(torch.randint(1, 40, (1,), generator=g)), generator=g)
        for i in range(300)
    }
    save_file(tensors, str(f))
    for _ in range(5):
        got = dict(iter_staged([f], "cpu", threads=8, chunk_bytes=48))
        assert all(torch.equal(got[k], v) for k, v in tensors.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_through_pinned_buffers(tmp_path: Path) -> None:
    files = random_shards(tmp_path, seed=4)
    want = library(files)
    for chunk in (64, 4096, 1 << 26):
        got = list(iter_staged(files, "cuda", threads=4, chunk_bytes=chunk))
        assert sorted(n for n, _ in got) == sorted(want)
        for name, t in got:
            assert t.device.type == "cuda"
            w = want[name]
            assert (t.dtype, t.shape) == (w.dtype, w.shape), name
            assert torch.equal(as_bytes(t.cpu()), as_bytes(w)), name


def test_no_staging_buffer_outlives_the_load(tmp_path: Path, monkeypatch) -> None:
    """Every staging buffer is let go before the memory is released (on a GPU they are pinned
    memory, which torch keeps cached for the process's life unless emptied once free), whether
    the load finished or stopped early; the tensors it gave stay valid."""
    import weakref

    from ember.models import weight_staging

    made: list[weakref.ref] = []
    alive_at_release: list[int] = []
    real = weight_staging._Buffers.__init__

    def init(self, count: int, size: int, pin: bool) -> None:
        real(self, count, size, pin)
        made.extend(weakref.ref(b) for b in self._free)

    monkeypatch.setattr(weight_staging._Buffers, "__init__", init)
    monkeypatch.setattr(
        weight_staging,
        "release_cached",
        lambda cuda: alive_at_release.append(sum(r() is not None for r in made)),
    )
    files = random_shards(tmp_path, seed=6)
    got = dict(iter_staged(files, "cpu", threads=3, chunk_bytes=64))
    assert made and alive_at_release == [0]
    assert torch.equal(as_bytes(got["big"]), as_bytes(library(files)["big"]))
    made.clear()
    it = iter_staged(files, "cpu", threads=3, chunk_bytes=64)
    next(it)
    it.close()
    assert made and alive_at_release == [0, 0]
    # A load beside a graph capture leaves the release to the thread that waits for it.
    made.clear()
    assert dict(iter_staged(files, "cpu", threads=3, chunk_bytes=64, release=False)).keys() == (
        got.keys()
    )
    assert made and alive_at_release == [0, 0]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs os.setpriority (Linux)")
def test_readers_beside_other_work_run_at_a_lower_priority(tmp_path: Path, monkeypatch) -> None:
    """`nice` raises each reader thread's nice value by that much (the load beside the
    start-up compile yields it the CPU), the bytes unchanged; the calling thread is untouched."""
    from ember.models import weight_staging

    files = random_shards(tmp_path, seed=11)
    me = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, me)
    seen: dict[int, int] = {}
    real = weight_staging._pread_into

    def spy(fd, view, offset):
        tid = threading.get_native_id()
        seen[tid] = os.getpriority(os.PRIO_PROCESS, tid)
        return real(fd, view, offset)

    monkeypatch.setattr(weight_staging, "_pread_into", spy)
    got = dict(iter_staged(files, "cpu", threads=2, chunk_bytes=1000, nice=3))
    want = library(files)
    assert all(torch.equal(as_bytes(got[n]), as_bytes(w)) for n, w in want.items())
    assert seen and me not in seen
    assert set(seen.values()) == {min(base + 3, 19)}
    assert os.getpriority(os.PRIO_PROCESS, me) == base
