"""KVTransport between GPUs of one node: CUDA IPC handles, then device-to-device peer copies.

A process's address lists its registered tensors: for each, the CUDA IPC handle of its storage,
its base pointer (the absolute addresses peers will name) and its size. A peer opens the handles
once and turns absolute addresses into byte offsets. Nothing here orders the copies after the
owner's own kernels: the owner synchronizes before it announces its blocks (or reads ours).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.kv.transport.base import KVTransport, TransferError, check_batch, check_registrable

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, frozen=True)
class Region:
    """A registered tensor: `nbytes` bytes from absolute address `base`, as a uint8 view."""

    base: int
    nbytes: int
    view: torch.Tensor


def locate(regions: Sequence[Region], addr: int, nbytes: int) -> tuple[torch.Tensor, int]:
    """(view, byte offset) of the region that holds all of [addr, addr + nbytes)."""
    for r in regions:
        if r.base <= addr and addr + nbytes <= r.base + r.nbytes:
            return r.view, addr - r.base
    raise TransferError(f"{nbytes} bytes at {addr:#x} lie outside the registered memory")


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self) -> None:
        self._local: list[Region] = []
        self._shared: list[dict[str, Any]] = []
        self._peers: dict[str, list[Region]] = {}
        self._streams: dict[Any, Any] = {}  # torch.device -> torch.cuda.Stream, made on first use

    def register(self, tensor: torch.Tensor) -> int:
        import torch

        nbytes = check_registrable(tensor)
        if tensor.device.type != "cuda":
            raise ValueError(f"CUDA IPC registers CUDA tensors, not {tensor.device}")
        storage = tensor.untyped_storage()
        device, handle, size, offset, rc_handle, rc_offset, event, event_sync = (
            storage._share_cuda_()
        )
        # JSON, not pickle: an address arrives from another process, and unpickling runs code.
        self._shared.append(
            {
                "uuid": str(torch.cuda.get_device_properties(device).uuid),
                "storage": [_b64(handle), size, offset, _b64(rc_handle), rc_offset],
                "event": [_b64(event), event_sync],
                "skip": tensor.data_ptr() - storage.data_ptr(),
                "base": tensor.data_ptr(),
                "nbytes": nbytes,
            }
        )
        view = tensor.reshape(-1).view(torch.uint8)
        self._local.append(Region(tensor.data_ptr(), nbytes, view))
        return tensor.data_ptr()

    @property
    def address(self) -> str:
        return base64.urlsafe_b64encode(json.dumps(self._shared).encode()).decode()

    def read(
        self,
        peer: str,
        remote_addrs: Sequence[int],
        local_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        check_batch(remote_addrs, local_addrs, lengths)
        self._copy(self._open(peer), remote_addrs, self._local, local_addrs, lengths)

    def write(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        check_batch(local_addrs, remote_addrs, lengths)
        self._copy(self._local, local_addrs, self._open(peer), remote_addrs, lengths)

    def _copy(
        self,
        src: Sequence[Region],
        src_addrs: Sequence[int],
        dst: Sequence[Region],
        dst_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        import torch

        try:
            pairs = []
            for s, d, n in zip(src_addrs, dst_addrs, lengths, strict=True):
                sview, soff = locate(src, s, n)
                dview, doff = locate(dst, d, n)
                pairs.append((dview[doff : doff + n], sview[soff : soff + n]))
            # On a stream of our own, after whatever this process had queued on its current stream
            # (a step still writing blocks that were freed and are now the destination), and
            # waited on alone: a device-wide synchronize would also wait for, and stall, the
            # engine's decode steps queued behind it.
            by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for dst_part, src_part in pairs:
                by_device.setdefault(dst_part.device, []).append((dst_part, src_part))
            streams = []
            for device, group in by_device.items():
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    for dst_part, src_part in group:
                        dst_part.copy_(src_part, non_blocking=True)
                streams.append(stream)
            for stream in streams:
                stream.synchronize()
        except TransferError:
            raise
        except RuntimeError as exc:
            raise TransferError(f"CUDA IPC copy failed: {exc}") from exc

    def _open(self, peer: str) -> list[Region]:
        if peer not in self._peers:
            try:
                self._peers[peer] = [
                    _open_region(r) for r in json.loads(base64.urlsafe_b64decode(peer))
                ]
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:
                raise TransferError(f"cannot open the CUDA IPC address of a peer: {exc}") from exc
        return self._peers[peer]

    def close(self) -> None:
        self._peers.clear()  # drops the opened storages, which closes their IPC handles
        self._local.clear()
        self._shared.clear()


def _open_region(shared: dict[str, Any]) -> Region:
    import torch

    # Open on the GPU that owns the memory if this process sees it (device numbers differ between
    # processes with different CUDA_VISIBLE_DEVICES), else on ours, reaching it by peer access.
    uuids = [
        str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
    ]
    index = uuids.index(shared["uuid"]) if shared["uuid"] in uuids else torch.cuda.current_device()
    handle, size, offset, rc_handle, rc_offset = shared["storage"]
    event, event_sync = shared["event"]
    torch.cuda._lazy_init()
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            _unb64(handle),
            size,
            offset,
            _unb64(rc_handle),
            rc_offset,
            _unb64(event),
            event_sync,
        )
    view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    view.set_(storage, shared["skip"], (shared["nbytes"],))
    return Region(shared["base"], shared["nbytes"], view)


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
