"""benchmarks/cold_import.py's eviction: a mount that refuses fsync on a read-only descriptor
(EINVAL, an H200 host's library files) still has the file dropped from the page cache."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cold_import  # noqa: E402


@pytest.mark.parametrize("fsync_fails", [False, True])
def test_evict_drops_each_readable_file_even_where_fsync_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync_fails: bool
) -> None:
    files = [tmp_path / "a.so", tmp_path / "b.so"]
    files[0].write_bytes(b"x" * 1000)
    files[1].write_bytes(b"y" * 24)
    advised: list[int] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        advised.append(os.fstat(fd).st_size)
        real_fadvise(fd, offset, length, advice)

    def refuse(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    if fsync_fails:
        monkeypatch.setattr(os, "fsync", refuse)
    missing = tmp_path / "missing.so"
    assert cold_import.evict([*files, missing]) == 1024
    assert advised == [1000, 24]
