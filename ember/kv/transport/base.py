"""The KV transport interface: register memory, then read or write byte regions of a peer's.

A peer is named by the string its own transport reports as `address`; addresses are plain ints
(pointers into registered memory), so the same calls work for CPU memory over TCP, GPU memory over
RDMA, or CUDA IPC, and a third backend (NIXL, say) fits behind them without changing callers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TransferError(RuntimeError):
    """A transfer failed or timed out; the destination bytes are undefined afterwards."""


class KVTransport(ABC):
    name: str
    exposed: bool = False
    """Whether other hosts reach this transport's memory through a network port with no access
    control of its own (Mooncake): the blocks it moves then carry keyed tags."""

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zeroed tensor for the KV cache in memory this transport can `register` (plain
        memory, unless the transport needs its own, as shared memory does)."""
        import torch

        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    @abstractmethod
    def register(self, tensor: torch.Tensor) -> int:
        """Make `tensor`'s memory reachable by peers; return its base address (`data_ptr`).

        The tensor must be contiguous, and the caller keeps it alive as long as the transport.
        """

    @property
    @abstractmethod
    def address(self) -> str:
        """What a peer passes as `peer` to reach this process's registered memory."""

    @abstractmethod
    def read(
        self,
        peer: str,
        remote_addrs: Sequence[int],
        local_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Pull `lengths[i]` bytes at the peer's `remote_addrs[i]` into our `local_addrs[i]`.

        Returns when every byte has landed; raises TransferError on any failure, within a bound.
        """

    @abstractmethod
    def write(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Push our `local_addrs[i]` into the peer's `remote_addrs[i]`; same rules as `read`."""

    @abstractmethod
    def close(self) -> None:
        """Release the registrations and connections; the transport is unusable afterwards."""


def check_batch(a: Sequence[int], b: Sequence[int], lengths: Sequence[int]) -> int:
    """Total bytes of a batch; ValueError if its three lists disagree (a caller's bug)."""
    if not len(a) == len(b) == len(lengths):
        raise ValueError(f"batch lists differ in length: {len(a)}, {len(b)}, {len(lengths)}")
    if any(n <= 0 for n in lengths):
        raise ValueError("every region length must be > 0")
    return sum(lengths)


def check_registrable(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`, which must be contiguous and non-empty to be registered."""
    if not tensor.is_contiguous():
        raise ValueError("only a contiguous tensor can be registered")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ValueError("cannot register an empty tensor")
    return nbytes
