"""Load or recompute: a tier hit is worth loading only if moving its bytes beats prefilling it.

Each medium's bandwidth is measured (an exponentially weighted mean over completed loads) and starts
from a conservative default; the engine feeds its measured prefill speed. Disk and store blocks go
through host memory, so their load time is their own read plus the host -> GPU copy.
"""

from __future__ import annotations

import threading

from ember.kv.tiers.base import BlockLayout, Medium, TierHit

# Conservative until measured (an H100's pinned host -> GPU copy runs at ~25 GB/s, NVMe at 2-7 GB/s).
DEFAULT_BANDWIDTH: dict[Medium, float] = {"cpu": 8e9, "disk": 1e9, "store": 1e9}
"""Bytes per second: host -> GPU for "cpu", disk / store -> host for the others."""
DEFAULT_LATENCY: dict[Medium, float] = {"cpu": 20e-6, "disk": 500e-6, "store": 1e-3}
"""Seconds a load from the medium costs whatever its size (a launch, a syscall, a round trip)."""
DEFAULT_PREFILL_TOK_S = 10_000.0
"""Until the engine reports its own: about an 8B model's prefill on one H100."""


class CostModel:
    """Estimates of load and recompute times; thread-safe (loads finish in the manager's thread)."""

    def __init__(
        self,
        layout: BlockLayout,
        bandwidth: dict[Medium, float] | None = None,
        latency: dict[Medium, float] | None = None,
        prefill_tok_s: float = DEFAULT_PREFILL_TOK_S,
        alpha: float = 0.25,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if prefill_tok_s <= 0:
            raise ValueError(f"prefill_tok_s must be > 0, got {prefill_tok_s}")
        self.layout = layout
        self.alpha = alpha
        self._bandwidth = dict(DEFAULT_BANDWIDTH) | (bandwidth or {})
        self._latency = dict(DEFAULT_LATENCY) | (latency or {})
        self._prefill_tok_s = prefill_tok_s
        self._measured: set[str] = set()
        self._lock = threading.Lock()

    # -- measurements ------------------------------------------------------------------------

    def observe_load(self, medium: Medium, nbytes: int, seconds: float) -> None:
        """A completed transfer of `nbytes` from `medium` (to host, or host to GPU for "cpu")."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._bandwidth[medium] = self._mean(medium, self._bandwidth[medium], nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine prefilled `tokens` prompt tokens in `seconds` of step time."""
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._prefill_tok_s = self._mean("prefill", self._prefill_tok_s, tokens / seconds)

    def _mean(self, name: str, old: float, sample: float) -> float:
        """The first measurement replaces the default; later ones move the mean by `alpha`."""
        if name not in self._measured:
            self._measured.add(name)
            return sample
        return (1 - self.alpha) * old + self.alpha * sample

    def bandwidth(self, medium: Medium) -> float:
        with self._lock:
            return self._bandwidth[medium]

    @property
    def prefill_tok_s(self) -> float:
        with self._lock:
            return self._prefill_tok_s

    # -- estimates ---------------------------------------------------------------------------

    def load_seconds(self, hit: TierHit) -> float:
        """Time to bring the hit's blocks to the GPU: each lower medium's read, then one host ->
        GPU copy of all of them."""
        if hit.num_blocks == 0:
            return 0.0
        nbytes = self.layout.nbytes
        with self._lock:
            t = self._latency["cpu"] + hit.num_blocks * nbytes / self._bandwidth["cpu"]
            for medium, blocks in (("disk", hit.disk), ("store", hit.store)):
                if blocks:
                    t += self._latency[medium] + blocks * nbytes / self._bandwidth[medium]
            return t

    def recompute_seconds(self, num_blocks: int, prefill_tok_s: float | None = None) -> float:
        speed = self.prefill_tok_s if prefill_tok_s is None else prefill_tok_s
        return num_blocks * self.layout.block_size / speed

    def should_load(self, hit: TierHit, prefill_tok_s: float | None = None) -> bool:
        """Whether loading the whole hit is faster than prefilling its tokens."""
        if hit.num_blocks == 0:
            return False
        return self.load_seconds(hit) < self.recompute_seconds(hit.num_blocks, prefill_tok_s)

    def plan(self, hit: TierHit, prefill_tok_s: float | None = None) -> TierHit:
        """The prefix of the hit worth loading (host, host + disk, or all), saving the most time
        over recomputing; empty when none saves any."""
        options = [
            TierHit(host=hit.host),
            TierHit(host=hit.host, disk=hit.disk),
            hit,
        ]
        best, saved = TierHit(), 0.0
        for option in options:
            gain = self.recompute_seconds(option.num_blocks, prefill_tok_s) - self.load_seconds(
                option
            )
            if option.num_blocks and gain > saved:
                best, saved = option, gain
        return best
