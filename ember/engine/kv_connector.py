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
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ember.kv.transport.block_tags import BlockTagger
from ember.kv_transfer_params import KVTransferParams
from ember.trust import internal_headers

if TYPE_CHECKING:
    import torch

    from ember.engine.request import Request
    from ember.kv.kv_cache_manager import KVCacheManager
    from ember.kv.transport import KVTransport

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0


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
    ) -> None:
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
        self.base_addr = transport.register(kv_cache)
        self.tagger = BlockTagger(secret, kv_cache) if transport.exposed else None
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
        block_ids = self.kv.block_ids(req.request_id)
        tags = self.tagger.tags(block_ids, lease_id) if self.tagger is not None else []
        return KVTransferParams(
            engine_id=self.engine_id,
            lease_id=lease_id,
            block_ids=block_ids,
            block_tags=tags,
            transfer_address=self.transport.address,
            kv_base_addr=self.base_addr,
            block_bytes=self.block_bytes,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_token_id=req.output_token_ids[0],
            lease_s=self.lease_s,
        )

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
        local = self.kv.block_ids(req.request_id)
        fut = self._executor.submit(self._load, params, local, skip_blocks)
        self._loads[req.request_id] = (req, fut)

    def poll_loads(self) -> list[tuple[Request, bool]]:
        """Loads that ended since the last call, with whether their KV can be trusted."""
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

    def _load(self, params: KVTransferParams, local: list[int], skip: int) -> bool:
        remote = params.block_ids
        ok = False
        try:
            if params.block_bytes != self.block_bytes:
                raise ValueError(
                    f"KV layouts differ: {params.block_bytes} bytes a block there, "
                    f"{self.block_bytes} here (model, dtype and block size must match)"
                )
            if len(remote) != len(local):
                raise ValueError(f"{len(remote)} remote blocks for {len(local)} local ones")
            from ember.kv.transport import pair_regions

            srcs, dsts, lens = pair_regions(
                params.kv_base_addr, self.base_addr, self.block_bytes, remote[skip:], local[skip:]
            )
            if srcs:
                t0 = time.perf_counter()
                self.transport.read(params.transfer_address, srcs, dsts, lens)
                self.load_seconds += time.perf_counter() - t0
                self.load_bytes += sum(lens)
            if self.tagger is not None and not self.tagger.verify(
                local[skip:], params.lease_id, params.block_tags[skip:], first=skip
            ):
                self.tag_failures += 1
                raise ValueError("a block's tag does not match: forged or damaged KV refused")
            ok = True
        except Exception as e:
            log.warning("KV read for lease %s failed: %s", params.lease_id, e)
        # Release either way; the read counts only if the lease was still held after it.
        return self._release_remote(params) and ok

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
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        for lid in list(self.leases):
            self.release(lid)
        self.transport.close()
