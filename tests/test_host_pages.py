"""ember/host_pages.py: pinned host memory kept out of forked children, and huge pages asked for,
over a tensor's own pages only."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ember.host_pages import PAGE, advise_huge_pages, keep_from_forks

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc are Linux's")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_buffer_kept_from_forks_is_marked_and_its_neighbours_are_not() -> None:
    t = torch.empty(64 << 20, dtype=torch.uint8)
    before = vm_flags(t.data_ptr() + PAGE)
    assert "dc" not in before
    assert keep_from_forks(t)
    first = -(-t.data_ptr() // PAGE) * PAGE
    assert "dc" in vm_flags(first)
    assert "dc" in vm_flags(t.data_ptr() + t.numel() - PAGE - 1)
    # the partial page at its start (the allocator's header) is shared with memory not its own
    if first > t.data_ptr():
        assert "dc" not in vm_flags(t.data_ptr())
    other = torch.empty(64 << 20, dtype=torch.uint8)
    assert "dc" not in vm_flags(other.data_ptr() + PAGE)


def test_a_forked_child_runs_beside_memory_kept_from_it() -> None:
    t = torch.ones(16 << 20, dtype=torch.uint8)
    keep_from_forks(t)
    pid = os.fork()
    if pid == 0:
        os._exit(7)  # the child never reads the buffer: it is not mapped there
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7
    assert int(t.sum()) == t.numel()  # the parent's copy is whole


def test_advice_on_a_tensor_smaller_than_a_page_touches_nothing() -> None:
    small = torch.empty(100, dtype=torch.uint8)
    assert not keep_from_forks(small)
    assert not advise_huge_pages(small)
