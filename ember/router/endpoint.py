"""One engine endpoint as the router sees it: the load it sent there, the engine's own `/load`
report, and the cost model that `cost.choose` minimises (Dynamo's `prefill_cost + decode_cost`).

Costs are in tokens of work: one uncached prompt token waiting for prefill, or one context token of
a sequence being decoded, costs 1.0. The KV pressure term is expressed in the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("prefill", "decode", "both")

PREFILL_WEIGHT = 1.0
"""Cost of one uncached prompt token queued for prefill (Dynamo weighs prefill and decode blocks
alike by default; its `overlap_score_weight` is this knob)."""
TIER_LOAD_WEIGHT: dict[str, float] = {"gpu": 0.0, "cpu": 0.1, "disk": 0.3, "store": 0.4}
"""Cost of one prompt token an engine loads from a KV medium instead of prefilling it, as a share of
PREFILL_WEIGHT. An engine loads a block only when its own cost model says loading beats
recomputing, so a tier's tokens cost less than a miss's, and more the slower the medium: host
memory is a fast copy (~25 GB/s pinned on an H100), disk and a store over the network are
slower, and their hits are hints (evicted, or written on a store that dropped them)."""
DECODE_WEIGHT = 1.0
"""Cost of one context token of a sequence being decoded (attention reads it on every step)."""
DECODE_REPORT_WEIGHT = 0.5
"""How far one `/load` report pulls the router's decode counter towards the engine's number."""
KV_KNEE = 0.8
"""KV usage below which memory costs nothing beyond the tokens already counted."""
KV_PRESSURE_TOKENS = 16_384.0
"""Extra cost at 100% KV usage, ramping linearly from `KV_KNEE`: enough to steer away from an engine
about to preempt, small enough that a long cached prefix elsewhere can still win."""


class NoEndpointError(RuntimeError):
    """No healthy endpoint can take the request."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """An engine's answer to `GET /load`, stamped with the router's monotonic clock on receipt."""

    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    """Uncomputed prompt tokens of waiting and partially prefilled requests."""
    num_decode_tokens: int
    """Context tokens of requests that are decoding."""
    kv_usage: float
    """Fraction of KV blocks in use, 0..1."""
    at: float

    @classmethod
    def from_load_json(cls, body: Mapping[str, Any], at: float) -> LoadReport:
        """Parse the JSON body of ember's `/load` (keys as `ember.server.api_server` writes them)."""
        try:
            return cls(
                num_running=int(body["running"]),
                num_waiting=int(body["waiting"]),
                num_prefill_tokens=int(body["prefill_tokens"]),
                num_decode_tokens=int(body["decode_tokens"]),
                kv_usage=float(body["kv_usage"]),
                at=at,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed /load report: {e!r}") from e


@dataclass(slots=True)
class Endpoint:
    url: str
    role: str
    """One of ROLES: "prefill", "decode" or "both" (colocated)."""
    healthy: bool = True
    inflight_prefill_tokens: int = 0
    """Uncached prompt tokens of requests sent here whose prefill has not returned."""
    active_decode_tokens: int = 0
    """Context tokens of sequences decoding here (corrected by each report)."""
    active_requests: int = 0
    reported: LoadReport | None = None
    progress: tuple[Any, ...] = ()
    """The engine's counters that move whenever it works (see `note_progress`)."""
    progress_at: float = 0.0
    """When (monotonic) those counters last changed."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"endpoint {self.url}: role {self.role!r} is not one of {ROLES}")

    def add_load(
        self, *, prefill_tokens: int = 0, decode_tokens: int = 0, requests: int = 0
    ) -> None:
        """Count work sent here (a prefill leg, a decode leg starting, a streamed token)."""
        _check_non_negative(prefill_tokens, decode_tokens, requests)
        self.inflight_prefill_tokens += prefill_tokens
        self.active_decode_tokens += decode_tokens
        self.active_requests += requests

    def remove_load(
        self, *, prefill_tokens: int = 0, decode_tokens: int = 0, requests: int = 0
    ) -> None:
        """Uncount finished work. Clamps at zero: a report may already have taken it off."""
        _check_non_negative(prefill_tokens, decode_tokens, requests)
        self.inflight_prefill_tokens = max(0, self.inflight_prefill_tokens - prefill_tokens)
        self.active_decode_tokens = max(0, self.active_decode_tokens - decode_tokens)
        self.active_requests = max(0, self.active_requests - requests)

    def apply_report(self, report: LoadReport) -> None:
        """Correct the router's view with the engine's.

        Prefill: the report is kept as a floor, `queued_prefill_tokens = max(counter, reported)`, and
        never folded into the counter. The counter is exact for the router's own traffic and covers
        prompts still on the wire that the report cannot see; the report adds what the router does
        not see (other clients, a prefix evicted before the prompt arrived). Under-counting prefill
        is how cache-aware routers pile onto one endpoint, hence the max. Folding the max into the
        counter would ratchet: the router only ever removes what it added.

        Decode: the counter is blended towards the report, `c = (1 - w) c + w reported`. Decode load
        moves slowly (sequences live for seconds, context grows a token a step), so the report is
        nearly current and heals the counter's drift (tokens the router missed, sequences ended
        without notice); the blend damps the race with a sequence that started after the snapshot.
        Repeated reports converge on the engine's number, so nothing ratchets.

        A report older than the one held (a late answer to an earlier poll) is ignored.
        """
        if self.reported is not None and report.at < self.reported.at:
            return
        w = DECODE_REPORT_WEIGHT
        blended = (1.0 - w) * self.active_decode_tokens + w * report.num_decode_tokens
        self.active_decode_tokens = round(blended)
        self.reported = report

    def note_progress(self, counters: tuple[Any, ...], now: float) -> None:
        """Record the engine's work counters from a `/load` report: a busy engine changes them
        every step (its queue shrinks, its context grows), a hung one does not."""
        if counters != self.progress:
            self.progress, self.progress_at = counters, now

    def progressing(self, window_s: float, now: float) -> bool:
        """Whether the engine answers `/load` and did some work in the last `window_s`: a request
        waiting in its queue is then waiting its turn, not stuck."""
        return self.healthy and now - self.progress_at < window_s

    @property
    def queued_prefill_tokens(self) -> int:
        """Uncached prompt tokens ahead of a new request: max(router counter, engine's report)."""
        reported = self.reported.num_prefill_tokens if self.reported is not None else 0
        return max(self.inflight_prefill_tokens, reported)

    @property
    def kv_usage(self) -> float:
        return self.reported.kv_usage if self.reported is not None else 0.0

    def prefill_cost(self, new_tokens: float = 0) -> float:
        """PREFILL_WEIGHT * (queued uncached prompt tokens + `new_tokens`), in tokens."""
        return PREFILL_WEIGHT * (self.queued_prefill_tokens + new_tokens)

    def decode_cost(self, new_tokens: int = 0) -> float:
        """DECODE_WEIGHT * (active decode tokens + `new_tokens`) + KV pressure, in tokens."""
        return DECODE_WEIGHT * (self.active_decode_tokens + new_tokens) + self.kv_pressure()

    def kv_pressure(self) -> float:
        """KV_PRESSURE_TOKENS * (kv_usage - KV_KNEE) / (1 - KV_KNEE), zero below the knee."""
        over = max(0.0, min(self.kv_usage, 1.0) - KV_KNEE)
        return KV_PRESSURE_TOKENS * over / (1.0 - KV_KNEE)


def _check_non_negative(*counts: int) -> None:
    if any(c < 0 for c in counts):
        raise ValueError(f"load counts must be >= 0, got {counts}")
