"""The scheduler's admissions that wait for KV to arrive before the request runs: a prompt's KV read
from a prefill engine (disaggregation, decode role) or loaded from the KV tiers below the GPU (host,
disk, store). A mixin of `Scheduler`, kept apart so that the step loop reads on its own."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember.engine.request import Request, RequestStatus
from ember.kv.data_parallel import DataParallelKV
from ember.kv.kv_cache_manager import KVCacheManager
from ember.kv.tiers.base import TierHit

if TYPE_CHECKING:
    from ember.engine.kv_connector import KVConnector
    from ember.kv.block_pool import KVBlock
    from ember.kv.tiers import TierManager


@dataclass(slots=True)
class TierLoad:
    """A request whose prompt blocks are being loaded from the KV tiers below the GPU."""

    num_gpu_blocks: int
    """Leading blocks that were GPU prefix-cache hits (not loaded)."""
    counts: bool
    """First admission: the loaded tokens count as cached (`num_cached_tokens`, prefix hits)."""


class KVLoads:
    """Remote and tier loads of `Scheduler` (which sets these attributes and the methods used)."""

    kv: KVCacheManager | DataParallelKV
    connector: KVConnector | None
    tiers: TierManager | None
    waiting: deque[Request]
    running: list[Request]
    loading: dict[str, Request]
    tier_loads: dict[str, TierLoad]
    prefix_queries: int
    prefix_hits: int

    def _computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        return self.kv.get_computed_blocks(
            req.block_hashes, req.all_token_ids, req.cache_salt, req.request_id
        )

    if TYPE_CHECKING:  # Scheduler's own

        def _allocate(
            self,
            req: Request,
            num_new: int,
            hits: list[KVBlock] | None = None,
            publish: bool = True,
            lookahead: int = 0,
        ) -> bool: ...

        def _publish(self, req: Request, num_tokens: int) -> None: ...

    # -- disaggregation ------------------------------------------------------------------------

    def _reads_remote_kv(self, req: Request) -> bool:
        return (
            self.connector is not None
            and self.connector.role == "decode"
            and req.kv_transfer is not None
            and req.kv_transfer.do_remote_prefill
        )

    def _start_load(self, req: Request) -> bool:
        """Allocate the prompt's blocks and read its KV from the prefill engine (not published in
        the prefix cache until the read is confirmed)."""
        if self.connector is None or req.kv_transfer is None:
            raise RuntimeError("a remote KV load needs a connector and transfer params")
        prompt = req.kv_transfer.num_prompt_tokens
        # Blocks this engine already holds (an agent's earlier turns, read for the last one) are
        # not read again: only the rest of the prompt comes over the wire.
        hits, num_hit = self._computed_blocks(req)
        if not self._allocate(req, prompt - num_hit, hits, publish=False):
            return False
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += num_hit
        self.loading[req.request_id] = req
        self.connector.start_load(req, skip_blocks=len(hits))
        return True

    def _collect_loads(self) -> None:
        if self.connector is None:
            return
        for req, ok in self.connector.poll_loads():
            self.loading.pop(req.request_id, None)
            if req.is_finished:  # aborted while its blocks were being written: free them now
                self.kv.free(req.request_id)
                continue
            params = req.kv_transfer
            if ok and params is not None:
                req.num_computed_tokens = params.num_prompt_tokens
                self._publish(req, params.num_prompt_tokens)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
            else:  # prefill here instead: slower, never wrong
                self.kv.free(req.request_id)
                req.kv_transfer = None
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)

    # -- KV tiers --------------------------------------------------------------------------------

    def _prefetch(self, req: Request) -> None:
        """Start the store lookup of the prompt's full blocks now, so that it is in by the time
        the request reaches the head of the queue (scheduling never asks the store)."""
        if (
            self.tiers is None
            or req.scores_prompt
            or not self.kv.enable_prefix_caching
            or self._reads_remote_kv(req)
        ):
            return
        hashes = self.kv.update_block_hashes(req.block_hashes, req.all_token_ids, req.cache_salt)
        self.tiers.prefetch(req.request_id, hashes[: (req.num_tokens - 1) // self.kv.block_size])

    def _tier_plan(self, req: Request, num_gpu_blocks: int) -> tuple[TierHit, TierHit] | None:
        """What the tiers hold after the GPU prefix hit, and the prefix of it worth loading (both
        empty: recompute); None while the request's store lookup is still out (within its grace).

        The last prompt token is always computed (its logits sample the first output), so at most
        the full blocks before it are looked up; the cost model decides whether loading the hit
        beats prefilling it at this engine's measured speed.
        """
        nothing = (TierHit(), TierHit())
        if self.tiers is None or req.scores_prompt or not self.kv.enable_prefix_caching:
            return nothing
        max_blocks = (req.num_tokens - 1) // self.kv.block_size
        if num_gpu_blocks >= max_blocks:
            return nothing
        hit = self.tiers.lookup(req.block_hashes[num_gpu_blocks:max_blocks], req.request_id)
        if hit is None:
            return None
        if hit.num_blocks == 0:
            return nothing
        return hit, self.tiers.plan(hit)

    def _tier_decided(
        self, req: Request, hit: TierHit, chosen: TierHit, num_gpu_blocks: int
    ) -> None:
        """The request is admitted: its store lookup goes, and its lookup (blocks found in each
        tier and not) and load-or-recompute decision are counted once, however many steps it
        waited for blocks."""
        if self.tiers is None:
            return
        self.tiers.forget(req.request_id)
        if not req.scores_prompt and self.kv.enable_prefix_caching:
            asked = (req.num_tokens - 1) // self.kv.block_size - num_gpu_blocks
            if asked > 0:
                self.tiers.count_lookup(asked, hit)
        if hit.num_blocks:
            self.tiers.count_decision(hit, chosen)

    def _start_tier_load(self, req: Request, hits: list[KVBlock], num_load: int) -> bool:
        """Allocate the GPU hit and `num_load` fresh blocks (unpublished until loaded) and start
        the load; False (and no change) when the pool is full."""
        if self.tiers is None:
            raise RuntimeError("a tier load needs the KV tiers")
        bs = self.kv.block_size
        if not self._allocate(req, num_load * bs, hits, publish=False):
            return False
        self.waiting.popleft()
        g = len(hits)
        counts = req.num_cached_tokens < 0
        if counts:
            req.num_cached_tokens = g * bs
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += g * bs
        req.status = RequestStatus.WAITING_FOR_TIER_KV
        self.loading[req.request_id] = req
        self.tier_loads[req.request_id] = TierLoad(g, counts)
        block_ids = self.kv.block_ids(req.request_id)[g:]
        self.tiers.start_load(req.request_id, req.block_hashes[g : g + num_load], block_ids)
        return True

    def _collect_tier_loads(self) -> None:
        """Finished loads: publish the blocks that arrived, recompute the rest (a short load)."""
        if self.tiers is None:
            return
        bs = self.kv.block_size
        for load_id, num_ok in self.tiers.poll_loads():
            req = self.loading.pop(load_id, None)
            load = self.tier_loads.pop(load_id, None)
            if req is None or load is None:  # cancelled: its blocks were freed at once
                continue
            computed = (load.num_gpu_blocks + num_ok) * bs
            self._publish(req, computed)
            req.num_computed_tokens = computed
            if load.counts:
                req.num_cached_tokens += num_ok * bs
                self.prefix_hits += num_ok * bs
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _cancel_tier_load(self, req: Request) -> None:
        """The request ended while loading: the manager stops writing its blocks (the GPU waits
        for a copy under way), so they may be freed at once."""
        if self.tiers is not None:
            self.tiers.cancel(req.request_id)
        self.loading.pop(req.request_id, None)
        self.tier_loads.pop(req.request_id, None)
