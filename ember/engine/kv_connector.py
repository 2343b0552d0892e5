"""Disaggregation inside the engine core. A prefill engine leases the KV blocks of a finished
prompt to a decode engine; a decode engine reads them over the KV transport before it decodes.

A lease ends when the decode side releases it, when it expires, or when the engine stops; only then
are the blocks freed. The decode side trusts a read only if the prefill engine confirms, after the
read, that the lease was still held: otherwise the blocks may have been reused while it read, and the
prompt is prefilled locally instead (never a token computed on wrong KV).

The decode side gets its parameters only after its API process checked them (signed by a peer with
the cluster secret, release URL among the configured peers); the release call carries the secret,
since /kv/release is an internal route. Over a transport that other hosts reach by network
(Mooncake), every leased block carries a tag keyed by the cluster secret, and the decode side uses
what it read only if every tag matches (ember/kv/transport/block_tags.py).

Either engine may be tensor-parallel, each rank holding its share of the KV heads. A
tensor-parallel prefill engine's workers register their caches with transports of their own and
tell rank 0 where (`Workers.kv_regions`), which puts every rank's address in the lease; the
blocks' ids are the same on every rank. Each decode rank reads its own heads of every block from
the prefill ranks that hold them (`ShardMap`, `ShardReader`: the same transport `read` of
narrower regions). Over Mooncake each prefill rank tags its own share (`TagKV`) and each decode
rank checks what it read, so tagged reads go between engines whose ranks hold the same heads.
Rank 0 sends the workers a `LoadKV` with the read's parameters, reads its share, and counts the
load good only once every worker reported success; then it releases the lease as a single rank
does. Any rank's failure, or a worker's end, and the prompt is prefilled here instead. A load's
bytes and seconds (the engine's `remote_kv_bytes`, `remote_kv_seconds`) are every rank's, until
the last one has read.

With data-parallel attention (ember/kv/data_parallel.py) a request's blocks are on one rank,
whole: a prefill engine's lease names that rank's cache alone, and on a decode engine only the
request's rank reads (`LoadKV.rank`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ember.engine.step_plan import LoadKV
from ember.kv.data_parallel import DataParallelKV
from ember.kv.transport.block_tags import BlockTagger, rank_lease
from ember.kv.transport.layout import ShardLayout
from ember.kv_transfer_params import KVTransferParams
from ember.trust import internal_headers

if TYPE_CHECKING:
    import torch

    from ember.engine.request import Request
    from ember.engine.workers import Workers
    from ember.kv.kv_cache_manager import KVCacheManager
    from ember.kv.transport import KVTransport
    from ember.models.config import ModelConfig

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0

Verdict = tuple[threading.Event, list[tuple[bool, int]]]
"""The workers' outcome of one load: the event is set once they all said (or one cannot), and
the list then holds whether every one read its share, and the bytes they read together."""


def kv_heads_of(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, KV heads) a rank of an engine of `size` ranks holds of `cfg`'s model; MLA's
    latent vector is whole on every rank."""
    from ember.distributed.shard import shard_heads

    heads = cfg.kv_cache_dims[1]
    if size == 1 or cfg.uses_mla:
        return 0, heads
    shard = shard_heads(cfg.num_attention_heads, cfg.num_key_value_heads, rank, size)
    return shard.kv_head_start, shard.num_kv_heads


class ShardMap:
    """Where this rank's KV heads lie in the blocks of a prefill engine of any number of ranks:
    from which of its ranks each run of heads is read, and how (`rank_layouts`)."""

    def __init__(
        self,
        runs: int,
        head_bytes: int,
        heads_of: Callable[[int, int], tuple[int, int]],
        rank: int = 0,
        size: int = 1,
    ) -> None:
        """`runs`: (layer, plane, slot) runs of a block; `heads_of(rank, size)`: (first KV head,
        KV heads) of a rank of an engine of `size` ranks."""
        self.runs = runs
        self.head_bytes = head_bytes
        self.heads_of = heads_of
        self.start, self.heads = heads_of(rank, size)
        self._layouts: dict[int, list[tuple[int, ShardLayout]]] = {}

    @classmethod
    def of(cls, cfg: ModelConfig, kv_cache: torch.Tensor, rank: int = 0, size: int = 1) -> ShardMap:
        """A model's: `kv_cache` is this rank's [num_blocks, layers, planes, block_size, heads,
        head_dim]."""
        _, layers, planes, block_size, _, head_dim = kv_cache.shape
        runs, head_bytes = layers * planes * block_size, head_dim * kv_cache.element_size()
        return cls(runs, head_bytes, lambda r, n: kv_heads_of(cfg, r, n), rank, size)

    @classmethod
    def whole(cls, block_bytes: int) -> ShardMap:
        """Whole blocks of an engine of one rank (no model at hand: the connector's tests)."""

        def one_rank(rank: int, size: int) -> tuple[int, int]:
            if size != 1:
                raise ValueError("whole-block KV reads take a prefill engine of one rank")
            return 0, 1

        return cls(1, block_bytes, one_rank)

    def remote_block_bytes(self, size: int) -> int:
        """Bytes of a block on each rank of a prefill engine of `size` ranks."""
        return self.runs * self.heads_of(0, size)[1] * self.head_bytes

    def rank_layouts(self, size: int) -> list[tuple[int, ShardLayout]]:
        """(prefill rank, layout) for a prefill engine of `size` ranks: each run of this rank's
        heads read from the first of its ranks that holds them."""
        if size in self._layouts:
            return self._layouts[size]
        held = [self.heads_of(p, size) for p in range(size)]
        out: list[tuple[int, ShardLayout]] = []
        for h in range(self.start, self.start + self.heads):
            p = next((p for p, (s, n) in enumerate(held) if s <= h < s + n), None)
            if p is None:
                raise ValueError(f"no rank of a {size}-rank engine holds KV head {h}")
            src_start, src_heads = held[p]
            last = out[-1] if out else None
            if (
                last is not None
                and last[0] == p
                and (last[1].head_start + last[1].num_heads == h - src_start)
            ):
                out[-1] = (p, replace(last[1], count=last[1].num_heads + 1))
                continue
            layout = ShardLayout(
                self.runs,
                src_heads,
                self.heads,
                h - src_start,
                self.head_bytes,
                count=1,
                local_start=h - self.start,
            )
            out.append((p, layout))
        self._layouts[size] = out
        return out


class TagMismatch(ValueError):
    """A block's tag did not match what was read: forged or damaged KV, refused."""


@dataclass(frozen=True, slots=True)
class TagCheck:
    """The tags a read's blocks must match (over Mooncake): each prefill rank's, of its share
    of the blocks read, which are the lease's from `first` on."""

    lease_id: str
    rank_tags: list[list[str]]
    first: int = 0


class ShardReader:
    """One rank's reads of a prefill engine's blocks: its heads of each, from whichever of the
    engine's ranks hold them, into its own cache, through the transport that registered it.
    Over a transport other hosts reach (`tagger`), what it read is used only if every block's
    tag matches; a block's tag covers a prefill rank's whole share of it, so tagged reads go
    between engines whose ranks hold the same heads (the same size, or MLA's whole latent)."""

    def __init__(
        self,
        transport: KVTransport,
        kv_cache: torch.Tensor,
        shards: ShardMap,
        tagger: BlockTagger | None = None,
    ) -> None:
        self.transport = transport
        self.shards = shards
        self.tagger = tagger
        self.base_addr = transport.register(kv_cache)

    def read(
        self,
        peers: list[str],
        remote_bases: list[int],
        remote_block_bytes: int,
        remote_ids: list[int],
        local_ids: list[int],
        check: TagCheck | None = None,
    ) -> int:
        """Read the pairs of blocks from a prefill engine whose rank r's transport address and
        cache base are `peers[r]`, `remote_bases[r]`; return the bytes read. Raises on a layout
        that differs from this model's (another model, dtype or block size there), on a failed
        transfer, or (TagMismatch) on a block whose tag does not match."""
        size = len(peers)
        if size < 1 or len(remote_bases) != size:
            raise ValueError(f"{size} prefill ranks' addresses for {len(remote_bases)} bases")
        expected = self.shards.remote_block_bytes(size)
        if remote_block_bytes != expected:
            raise ValueError(
                f"KV layouts differ: {remote_block_bytes} bytes a block there, {expected} "
                f"expected of a {size}-rank prefill engine (model, dtype and block size must "
                "match)"
            )
        if len(remote_ids) != len(local_ids):
            raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local ones")
        layouts = self.shards.rank_layouts(size)
        if self.tagger is not None and not all(layout.whole for _, layout in layouts):
            raise ValueError(
                f"tagged KV (Mooncake) is read from a prefill engine whose ranks hold this "
                f"rank's heads whole: one of {size} ranks does not (give both engines the same "
                "tensor-parallel size)"
            )
        total = 0
        for rank, layout in layouts:
            srcs, dsts, lens = layout.pairs(
                remote_bases[rank], self.base_addr, remote_ids, local_ids
            )
            if srcs:
                self.transport.read(peers[rank], srcs, dsts, lens)
            total += sum(lens)
        if self.tagger is not None:
            self._verify(layouts, size, local_ids, check)
        return total

    def _verify(
        self,
        layouts: list[tuple[int, ShardLayout]],
        size: int,
        local_ids: list[int],
        check: TagCheck | None,
    ) -> None:
        assert self.tagger is not None
        if check is None or len(check.rank_tags) != size:
            raise TagMismatch("blocks over an exposed transport must come with every rank's tags")
        for rank, _ in layouts:
            lease = rank_lease(check.lease_id, rank, size)
            if not self.tagger.verify(local_ids, lease, check.rank_tags[rank], check.first):
                raise TagMismatch("a block's tag does not match: forged or damaged KV refused")

    def close(self) -> None:
        self.transport.close()


class KVConnector:
    def __init__(
        self,
        role: str,
        kv: KVCacheManager,
        kv_cache: torch.Tensor,
        transport: KVTransport,
        engine_id: str,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        secret: str = "",
        timeout_s: float = RELEASE_TIMEOUT_S,
        shards: ShardMap | None = None,
        workers: Workers | None = None,
    ) -> None:
        """`shards`: where this rank's heads lie in a prefill engine's blocks (None: whole
        blocks of an engine of one rank); `workers`: the other ranks of a tensor-parallel engine,
        which read their heads when told (decode), or hold theirs of the leased blocks
        (prefill)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"a KV connector is for the prefill or decode role, not {role!r}")
        self.role = role
        self.kv = kv
        self.transport = transport
        self.engine_id = engine_id
        self.lease_s = lease_s
        self.clock = clock
        self.secret = secret
        self.release_timeout_s = min(timeout_s, RELEASE_TIMEOUT_S)
        # The cache is block-major: one block of every layer is one contiguous region.
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        if shards is None:
            shards = ShardMap.whole(self.block_bytes)
        self.tagger = BlockTagger(secret, kv_cache) if transport.exposed else None
        self.reader = ShardReader(transport, kv_cache, shards, self.tagger)
        self.base_addr = self.reader.base_addr
        self.workers = workers
        self._next_load_id = 0
        self._ranks: dict[int, Verdict] = {}
        """Loads the workers are reading, by load id."""
        self._readers: dict[int, int | None] = {}
        """How many workers read each of those loads (None: all)."""
        self._closing = False
        self.tag_failures = 0
        """Loads refused because a block's tag did not match (forged or damaged KV)."""
        self.leases: dict[str, tuple[Request, float]] = {}
        self.lease_expiries = 0
        self.loads = 0
        self.load_failures = 0
        self.load_bytes = 0
        self.load_seconds = 0.0
        """Bytes read and wall time spent reading them, over the successful loads."""
        self._loads: dict[str, tuple[Request, Future[bool]]] = {}
        self._executor = ThreadPoolExecutor(2, "ember-kv-load") if role == "decode" else None

    # -- prefill side ----------------------------------------------------------------------

    def hold(self, req: Request) -> KVTransferParams:
        """Lease a finished prompt's blocks; the params tell a decode engine where they are."""
        lease_id = f"{self.engine_id}:{req.request_id}"
        self.leases[lease_id] = (req, self.clock() + self.lease_s)
        rank, block_ids = self._where(req.request_id)
        regions = [(self.transport.address, self.base_addr)]
        if self.workers is not None:
            regions += self.workers.kv_regions()
        # The ranks whose caches hold the blocks: every rank its heads' share, or with
        # data-parallel attention the request's own rank, whole (MLA's latent).
        holders = list(range(len(regions))) if rank is None else [rank]
        regions = [regions[r] for r in holders]
        tags = self._tags(lease_id, block_ids, holders)
        return KVTransferParams(
            engine_id=self.engine_id,
            lease_id=lease_id,
            block_ids=block_ids,
            block_tags=tags[0] if tags else [],
            transfer_address=regions[0][0],
            kv_base_addr=regions[0][1],
            block_bytes=self.block_bytes,
            rank_block_tags=tags[1:],
            rank_transfer_addresses=[address for address, _ in regions[1:]],
            rank_kv_base_addrs=[base for _, base in regions[1:]],
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_token_id=req.output_token_ids[0],
            lease_s=self.lease_s,
        )

    def _where(self, request_id: str) -> tuple[int | None, list[int]]:
        """The rank whose cache alone holds a request's blocks (data-parallel attention), and
        their ids in it; (None, the ids) where every rank holds its share of them."""
        if not isinstance(self.kv, DataParallelKV):
            return None, self.kv.block_ids(request_id)
        rank = self.kv.rank_of(request_id)
        if rank is None:
            raise RuntimeError(f"request {request_id} holds no blocks")
        first = rank * self.kv.blocks_per_rank
        return rank, [b - first for b in self.kv.block_ids(request_id)]

    def _tags(self, lease_id: str, block_ids: list[int], holders: list[int]) -> list[list[str]]:
        """Over Mooncake: each holding rank's tags of its share of the blocks, keyed by its
        place among the lease's ranks; rank 0 tags its own while the workers tag theirs."""
        if self.tagger is None:
            return []
        n = len(holders)
        keys = [""] * (self.workers.size if self.workers is not None else 1)
        for i, rank in enumerate(holders):
            keys[rank] = rank_lease(lease_id, i, n)
        asked = None
        if self.workers is not None and any(keys[1:]):
            asked = self.workers.ask_tags(keys, block_ids)
        got = {0: self.tagger.tags(block_ids, keys[0])} if keys[0] else {}
        if asked is not None and self.workers is not None:
            got |= self.workers.kv_tags(asked, sum(1 for k in keys[1:] if k))
        return [got[rank] for rank in holders]

    def release(self, lease_id: str) -> bool:
        """Free a lease's blocks; False if it is unknown (already released or expired)."""
        held = self.leases.pop(lease_id, None)
        if held is None:
            return False
        self.kv.free(held[0].request_id)
        return True

    def expire(self) -> int:
        now = self.clock()
        gone = [lid for lid, (_, until) in self.leases.items() if until <= now]
        for lid in gone:
            self.release(lid)
        self.lease_expiries += len(gone)
        if gone:
            log.warning("%d KV lease(s) expired before a decode engine read them", len(gone))
        return len(gone)

    # -- decode side -----------------------------------------------------------------------

    def start_load(self, req: Request, skip_blocks: int = 0) -> None:
        """Read `req`'s prompt KV into its (already allocated) blocks, in the background; the
        first `skip_blocks` are cached here already."""
        if self._executor is None or req.kv_transfer is None:
            raise RuntimeError("start_load needs the decode role and a request with params")
        params = req.kv_transfer
        rank, local = self._where(req.request_id)
        verdict = None
        if self.workers is not None and rank != 0:
            verdict = self._fan_out(params, local, skip_blocks, rank)
        here = rank in (None, 0)  # (data-parallel attention: only the request's rank reads)
        fut = self._executor.submit(self._load, params, local, skip_blocks, verdict, here)
        self._loads[req.request_id] = (req, fut)

    def _fan_out(
        self, params: KVTransferParams, local: list[int], skip: int, rank: int | None = None
    ) -> Verdict:
        """Tell every worker (or the one `rank` whose cache alone holds the request's blocks)
        to read its heads of the load's blocks; the workers' verdict to wait for. A worker that
        cannot be told fails the load (its verdict is set at once)."""
        assert self.workers is not None
        load_id = self._next_load_id
        self._next_load_id += 1
        verdict: Verdict = (threading.Event(), [])
        self._ranks[load_id] = verdict
        self._readers[load_id] = None if rank is None else 1
        n = min(len(params.block_ids), len(local))
        msg = LoadKV(
            load_id,
            params.peers,
            params.kv_base_addrs,
            params.block_bytes,
            params.block_ids[skip:n],
            local[skip:n],
            params.lease_id,
            [t[skip:n] for t in params.all_block_tags],
            skip,
            -1 if rank is None else rank,
        )
        try:
            self.workers.send(msg)
        except Exception as e:
            log.warning("could not ask the workers to read KV for %s: %s", params.lease_id, e)
            self._decide(load_id, (False, 0))
        return verdict

    def _decide(self, load_id: int, said: tuple[bool, int]) -> None:
        verdict = self._ranks.pop(load_id, None)
        if verdict is not None:
            verdict[1].append(said)
            verdict[0].set()

    def _hear_workers(self) -> None:
        """The workers' verdicts on the loads they read (rank 0's loop: the reports socket is
        its alone)."""
        if self.workers is None:
            return
        for load_id in list(self._ranks):
            said = self.workers.kv_load_done(load_id, self._readers.get(load_id))
            if said is not None:
                self._readers.pop(load_id, None)
                self._decide(load_id, said)

    def poll_loads(self) -> list[tuple[Request, bool]]:
        """Loads that ended since the last call, with whether their KV can be trusted."""
        self._hear_workers()
        done = [(rid, r, f) for rid, (r, f) in self._loads.items() if f.done()]
        out = []
        for rid, req, fut in done:
            del self._loads[rid]
            ok = fut.exception() is None and fut.result()
            if ok:
                self.loads += 1
            else:
                self.load_failures += 1
            out.append((req, ok))
        return out

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def _load(
        self,
        params: KVTransferParams,
        local: list[int],
        skip: int,
        verdict: Verdict | None = None,
        here: bool = True,
    ) -> bool:
        """`here`: this rank reads its share (else only the workers told read)."""
        remote = params.block_ids
        ok, nbytes, seconds = False, 0, 0.0
        t0 = time.perf_counter()
        try:
            if len(remote) != len(local):
                raise ValueError(f"{len(remote)} remote blocks for {len(local)} local ones")
            if here:
                tags = [t[skip:] for t in params.all_block_tags]
                check = TagCheck(params.lease_id, tags, skip) if self.tagger is not None else None
                nbytes = self.reader.read(
                    params.peers,
                    params.kv_base_addrs,
                    params.block_bytes,
                    remote[skip:],
                    local[skip:],
                    check,
                )
                seconds = time.perf_counter() - t0
            ok = True
        except TagMismatch as e:
            self.tag_failures += 1
            log.warning("KV read for lease %s refused: %s", params.lease_id, e)
        except Exception as e:
            log.warning("KV read for lease %s failed: %s", params.lease_id, e)
        if verdict is not None:
            workers_ok, worker_bytes = self._workers_read(verdict)
            if not workers_ok:
                log.warning("KV read for lease %s failed on a worker", params.lease_id)
                ok = False
            elif ok:
                nbytes += worker_bytes
                seconds = time.perf_counter() - t0  # until the last rank has read
        if ok and nbytes:
            self.load_seconds += seconds
            self.load_bytes += nbytes
        # Release either way; the read counts only if the lease was still held after it.
        return self._release_remote(params) and ok

    def _workers_read(self, verdict: Verdict) -> tuple[bool, int]:
        """Wait for every worker's verdict on a load (heard by `poll_loads`): the blocks stay
        this load's until then, since a worker may still be writing them. Their reads are
        bounded by the transport; a worker's end or the connector's close decides at once."""
        event, said = verdict
        while not event.wait(0.1):
            if self._closing:
                return False, 0
        return said[0] if said else (False, 0)

    def _release_remote(self, params: KVTransferParams) -> bool:
        if not params.release_url.startswith(("http://", "https://")):
            return False  # urllib would also open file: and ftp: URLs
        body = json.dumps({"lease_id": params.lease_id}).encode()
        headers = {"content-type": "application/json", **internal_headers(self.secret)}
        req = urllib.request.Request(params.release_url, body, headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.release_timeout_s) as resp:
                return bool(json.loads(resp.read()).get("released"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            log.warning("could not release KV lease %s: %s", params.lease_id, e)
            return False

    def close(self) -> None:
        self._closing = True
        for load_id in list(self._ranks):
            self._decide(load_id, False)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        for lid in list(self.leases):
            self.release(lid)
        self.transport.close()
