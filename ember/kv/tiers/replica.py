"""The KV host tier of a tensor-parallel engine: rank 0's `TierManager` decides everything (which
key lives in which host slot, what to offload and load, when), and every other rank repeats its
copies on its own heads, between its own cache and its own host memory, in the same slots.

Each rank's block holds its share of the heads, so its host memory has the same number of rows
as rank 0's, each of its own block's bytes. Rank 0 sends each copy after the step plan it follows
(`TierCopy`), so a worker makes it in the same order against its steps:

- an offload (cache -> host) after the step that wrote the blocks, on a side stream that waits
  for the work queued so far;
- a load (host -> cache) after every offload sent before it, on the same side stream: rank 0
  loads only keys whose own copy down has ended, and a worker's copy of those, queued earlier on
  the one stream, has ended too by then; and a slot rank 0 has reused was read by the loads
  queued before the offload that overwrites it;
- `TierFence(block_ids)` before a step that reads blocks just loaded or writes blocks handed
  out again: the worker's device waits for its copies still under way that touch them (rank 0
  cannot tell: its own copies' ends say nothing of a worker's).

On the CPU every copy is made at once (the worker's steps are synchronous). A worker's memory
grows in the background as rank 0's does, at the pace rank 0 sends (`TierPace`); a slot beyond
what it has grown yet is allocated on the spot (`HostMemory.grow_to`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ember.kv.tiers.host_memory import HostMemory, Pace


class Replicas(Protocol):
    """Where rank 0's tier sends its copies (ember/engine/kv_tiers.WorkerReplicas)."""

    def copy(self, up: bool, slots: list[int], gpu_ids: list[int]) -> None: ...

    def fence(self, block_ids: list[int]) -> None: ...


class HostReplica:
    """A worker's copy of rank 0's host tier: its memory and its cache's blocks."""

    def __init__(self, memory: HostMemory, gpu_blocks: torch.Tensor) -> None:
        """`gpu_blocks`: this rank's KV cache viewed as uint8 [num_blocks, row_bytes]."""
        if gpu_blocks.dtype != torch.uint8 or gpu_blocks.dim() != 2:
            raise ValueError(
                f"gpu_blocks must be uint8 [num_blocks, nbytes], got {gpu_blocks.dtype}"
            )
        if gpu_blocks.shape[1] != memory.row_bytes:
            raise ValueError(
                f"blocks of {gpu_blocks.shape[1]} bytes, host rows of {memory.row_bytes}"
            )
        self.memory = memory
        self.gpu_blocks = gpu_blocks
        self._cuda = gpu_blocks.is_cuda
        self._stream = torch.cuda.Stream(gpu_blocks.device) if self._cuda else None
        self._pending: list[tuple[torch.cuda.Event, frozenset[int]]] = []
        """Copies under way on the side stream: their end, and the blocks they touch."""
        self.copies = 0
        """Copies made (offloads and loads), for tests and logs."""

    def copy(self, up: bool, slots: list[int], gpu_ids: list[int]) -> None:
        """Rank 0's copy, on this rank's heads: host slots -> cache blocks when `up`, else the
        other way."""
        if len(slots) != len(gpu_ids):
            raise ValueError(f"{len(slots)} slots but {len(gpu_ids)} blocks")
        if not slots:
            return
        n = self.gpu_blocks.shape[0]
        if not all(0 <= b < n for b in gpu_ids) or min(slots) < 0:
            raise ValueError(f"a block outside the cache's {n} or a negative slot")
        self.memory.grow_to(max(slots) + 1)
        move = self.memory.copy_out if up else self.memory.copy_in
        self.copies += 1
        if self._stream is None:
            move(slots, self.gpu_blocks, gpu_ids, False)
            return
        compute = torch.cuda.current_stream(self.gpu_blocks.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)
            move(slots, self.gpu_blocks, gpu_ids, True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending = [p for p in self._pending if not p[0].query()]
        self._pending.append((done, frozenset(gpu_ids)))

    def fence(self, block_ids: list[int]) -> None:
        """The device's next work waits for the copies under way that touch `block_ids` (the
        host does not wait)."""
        if not self._pending:
            return
        wanted = set(block_ids)
        compute = torch.cuda.current_stream(self.gpu_blocks.device)
        for done, touched in self._pending:
            if not wanted.isdisjoint(touched):
                compute.wait_event(done)

    def set_pace(self, pace: Pace) -> None:
        self.memory.pace = pace

    def close(self) -> None:
        """Wait for the copies under way, then let the memory go."""
        for done, _ in self._pending:
            done.synchronize()
        self._pending = []
        self.memory.close()
