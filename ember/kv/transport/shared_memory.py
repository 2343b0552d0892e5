"""KVTransport between CPU engines of one host, with no network port: the KV cache lives in an
anonymous shared-memory file (`memfd_create`, mode 0600), and a peer maps it read-only through
`/proc/<pid>/fd/<fd>`, which the kernel opens only for processes of the same user. Nothing listens;
a peer's memory is never writable from outside it; the file goes with the last process that maps it
(no name in /dev/shm to leak).

A process's address names its one registered region: `shm:<pid>:<fd>:<nonce>:<base>:<nbytes>`.
The nonce is part of the file's name, checked through `/proc` before it is mapped, so an address
that outlives its engine (a reused pid or fd) maps nothing. Reads copy with `memmove` (ctypes lets
go of the GIL while it copies).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.kv.transport.base import KVTransport, TransferError, check_batch, check_registrable

if TYPE_CHECKING:
    import torch

_ADDRESS = re.compile(r"shm:(\d+):(\d+):([0-9a-f]{16}):(\d+):(\d+)")
MAX_PEERS = 16
"""Peers' files kept mapped at once (least recently read first out)."""


@dataclass(slots=True, frozen=True)
class Region:
    """Memory this process allocated in a shared file: `nbytes` from absolute address `base`."""

    fd: int
    nonce: str
    base: int
    nbytes: int

    def holds(self, addr: int, n: int) -> bool:
        return self.base <= addr and addr + n <= self.base + self.nbytes


@dataclass(slots=True)
class _PeerMap:
    base: int
    nbytes: int
    mapped: mmap.mmap
    view: Any  # numpy uint8 array over `mapped`: its address for memmove
    addr: int

    def holds(self, addr: int, n: int) -> bool:
        return self.base <= addr and addr + n <= self.base + self.nbytes


class SharedMemoryTransport(KVTransport):
    name = "shm"

    def __init__(self) -> None:
        self._allocated: list[Region] = []
        self._registered: list[Region] = []
        self._peers: OrderedDict[str, _PeerMap] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zeroed tensor in a new shared-memory file (0600), for `register`."""
        import torch

        if device.type != "cpu":
            raise ValueError(f"the shared-memory transport holds CPU tensors, not {device}")
        numel = math.prod(shape)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        nonce = secrets.token_hex(8)
        fd = os.memfd_create(f"ember-kv-{nonce}", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, max(nbytes, 1))
            tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
        except BaseException:
            os.close(fd)
            raise
        self._allocated.append(Region(fd, nonce, tensor.data_ptr(), nbytes))
        return tensor.view(*shape)

    def register(self, tensor: torch.Tensor) -> int:
        nbytes = check_registrable(tensor)
        ptr = tensor.data_ptr()
        for r in self._allocated:
            if r.holds(ptr, nbytes):
                if r not in self._registered:
                    self._registered.append(r)
                return ptr
        raise ValueError(
            "the shared-memory transport registers only memory it allocated (allocate())"
        )

    @property
    def address(self) -> str:
        if not self._registered:
            return ""
        r = self._registered[0]
        return f"shm:{os.getpid()}:{r.fd}:{r.nonce}:{r.base}:{r.nbytes}"

    def read(
        self,
        peer: str,
        remote_addrs: Sequence[int],
        local_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        check_batch(remote_addrs, local_addrs, lengths)
        src = self._peer(peer)
        held = src.view  # while held, an eviction cannot unmap the file under the copies
        for remote, local, n in zip(remote_addrs, local_addrs, lengths, strict=True):
            if not src.holds(remote, n):
                raise TransferError(f"{n} bytes at {remote:#x} lie outside the peer's memory")
            if not any(r.holds(local, n) for r in self._registered):
                raise TransferError(f"{n} bytes at {local:#x} lie outside the registered memory")
            ctypes.memmove(local, src.addr + (remote - src.base), n)
        del held

    def write(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        raise TransferError(
            "the shared-memory transport only reads: peers map each other read-only"
        )

    def _peer(self, peer: str) -> _PeerMap:
        with self._lock:
            if self._closed:
                raise TransferError("the shared-memory transport is closed")
            found = self._peers.get(peer)
            if found is not None:
                self._peers.move_to_end(peer)
                return found
            found = _map_peer(peer)
            self._peers[peer] = found
            while len(self._peers) > MAX_PEERS:
                _, old = self._peers.popitem(last=False)
                _unmap(old)
            return found

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for p in self._peers.values():
                _unmap(p)
            self._peers.clear()
        # Our own files stay open while the tensors over them live (the mapping keeps the memory;
        # the descriptors only name it for peers): close the names.
        for r in self._allocated:
            with contextlib.suppress(OSError):
                os.close(r.fd)
        self._allocated.clear()
        self._registered.clear()


def _map_peer(peer: str) -> _PeerMap:
    import numpy as np

    m = _ADDRESS.fullmatch(peer)
    if m is None:
        raise TransferError(f"not a shared-memory KV address: {peer[:80]!r}")
    pid, fd, nonce, base, nbytes = (
        m.group(1),
        m.group(2),
        m.group(3),
        int(m.group(4)),
        int(m.group(5)),
    )
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
        if not target.startswith(f"/memfd:ember-kv-{nonce} "):
            raise TransferError(f"{peer}: the peer's KV memory is gone")
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < nbytes:
                raise TransferError(f"{peer}: the peer's KV memory is smaller than it says")
            mapped = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
    except OSError as e:
        raise TransferError(f"cannot map the peer's KV memory {peer}: {e}") from e
    view = np.frombuffer(mapped, dtype=np.uint8)
    return _PeerMap(base, nbytes, mapped, view, int(view.ctypes.data))


def _unmap(p: _PeerMap) -> None:
    p.view = None
    # A read still holding it keeps the mapping: it goes when that read's view does.
    with contextlib.suppress(BufferError):
        p.mapped.close()
