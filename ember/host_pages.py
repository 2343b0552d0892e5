"""Advice to the kernel about large host buffers (madvise through ctypes): transparent huge pages
for memory about to be pinned, and keeping pinned memory out of forked children.

A fork copies a process's DMA-pinned anonymous pages into the child at once (Linux does not
share them copy-on-write: a write by either side would leave the device's mapping on the wrong
page). The engine core forks Triton compile workers during its start (ember/kernels/
compile_workers.py) while the KV host tier pins tens of GiB beside it: each fork copied the
tier, taking seconds and the child's own copy of the memory (a Kimi K2 start was killed for
memory). Marked MADV_DONTFORK, the range is simply absent from children, which never read it.
Both are hints: where madvise is missing (another OS) nothing changes."""

from __future__ import annotations

import ctypes
import functools

import torch

PAGE = 4096
HUGE_PAGE = 2 << 20
MADV_DONTFORK = 10
MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def _advise(t: torch.Tensor, advice: int, align: int) -> bool:
    """madvise(`advice`) over the part of `t`'s bytes aligned to `align` (never a byte outside
    `t`); whether the kernel took it."""
    libc = _libc()
    nbytes = t.numel() * t.element_size()
    begin = -(-t.data_ptr() // align) * align
    end = (t.data_ptr() + nbytes) // align * align
    if libc is None or end <= begin:
        return False
    return libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), advice) == 0


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Transparent huge pages over `t` (where the kernel's setting is "never" the pages stay
    4 KiB)."""
    return _advise(t, MADV_HUGEPAGE, HUGE_PAGE)


def keep_from_forks(t: torch.Tensor) -> bool:
    """`t`'s whole pages absent from processes this one forks (before it is pinned: see the
    module's doc)."""
    return _advise(t, MADV_DONTFORK, PAGE)
