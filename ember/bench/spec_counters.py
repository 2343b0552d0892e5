"""Speculative decoding as the server counts it: vLLM's `spec_decode_*` counters (under `ember:`
or `vllm:`) read from its /metrics before and after a run, and their difference summed up.

What the counters can tell is pooled over verification steps: 1 + accepted / drafts is the mean
number of tokens one verification of one request yields (its accepted drafts and the target's own
next token), weighted by drafts, not a mean over requests (no server reports drafts per request).
The difference also holds whatever else the server ran meanwhile. A server without the counters
(another OpenAI-compatible server, a router, which keeps none) reports nothing."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from ember.bench.fit import warn
from ember.home import local_cluster_secret
from ember.trust import SECRET_ENV, internal_headers

PREFIXES = ("ember:", "vllm:")
DRAFTS = "spec_decode_num_drafts"
DRAFT_TOKENS = "spec_decode_num_draft_tokens"
ACCEPTED = "spec_decode_num_accepted_tokens"
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
MAX_POSITIONS = 64
"""Draft positions read (ember's K is at most 16); a label past it is not a draft position."""
MEAN_ACCEPTED = "mean_accepted_length_per_step"
"""The report's key for 1 + accepted / drafts (a mean over verification steps, not requests)."""
SCOPE = (
    "pooled over the run's verification steps (the server's counters, after minus before), "
    "not averaged per request"
)


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """The cumulative counters, summed over the servers' models (and over several servers)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_pos: tuple[float, ...] = ()

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
            _zip_sum(self.accepted_per_pos, other.accepted_per_pos, 1.0),
        )

    def since(self, before: SpecCounters) -> SpecCounters | None:
        """What was counted after `before`; None if a counter went back (the server restarted)."""
        delta = SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
            _zip_sum(self.accepted_per_pos, before.accepted_per_pos, -1.0),
        )
        values = (delta.drafts, delta.draft_tokens, delta.accepted_tokens, *delta.accepted_per_pos)
        return None if any(v < 0 for v in values) else delta


def _zip_sum(a: tuple[float, ...], b: tuple[float, ...], sign: float) -> tuple[float, ...]:
    """a + sign * b by position; the shorter one counts 0 past its end (a position not yet seen)."""
    n = max(len(a), len(b))
    return tuple(
        (a[i] if i < len(a) else 0.0) + sign * (b[i] if i < len(b) else 0.0) for i in range(n)
    )


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text exposition; None when it has none of them (or is not
    Prometheus text at all)."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            prefix = next((p for p in PREFIXES if family.name.startswith(p)), None)
            if prefix is None or family.type != "counter":
                continue
            name = family.name[len(prefix) :]
            if name not in (DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS):
                continue
            totals.setdefault(name, 0.0)
            for s in family.samples:
                if not s.name.endswith("_total"):  # a client library's `_created` timestamps
                    continue
                if name == PER_POS:
                    pos = int(s.labels["position"])
                    if 0 <= pos < MAX_POSITIONS:
                        per_pos[pos] = per_pos.get(pos, 0.0) + s.value
                else:
                    totals[name] += s.value
    except (ValueError, KeyError, IndexError):  # not Prometheus text, or a sample without position
        return None
    if DRAFTS not in totals:
        return None
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(
        totals[DRAFTS], totals.get(DRAFT_TOKENS, 0.0), totals.get(ACCEPTED, 0.0), positions
    )


class Counters(Protocol):
    """Cumulative counters: summed over servers, and differenced over a run."""

    def __add__(self, other: Self, /) -> Self: ...

    def since(self, before: Self, /) -> Self | None: ...


C = TypeVar("C", bound=Counters)


class ScrapeError(Exception):
    """A /metrics that should have answered and did not (refused, unreachable)."""


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str | None:
    """GET `url`/metrics; None where the server has no such route (404). An ember server keeps it
    behind the cluster secret: asked again after a 401 with EMBER_CLUSTER_SECRET, else the secret
    of the local `ember up` that `url` belongs to (ember/home.py), if any (so the secret goes only
    to a server that asks for it, never to one whose metrics are open)."""
    target = url.rstrip("/") + "/metrics"
    try:
        try:
            return _get(target, {}, timeout_s)
        except urllib.error.HTTPError as e:
            secret = os.environ.get(SECRET_ENV) or local_cluster_secret(url)
            if e.code != 401 or not secret:
                raise
            return _get(target, internal_headers(secret), timeout_s)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        hint = (
            f" (ember's needs the cluster secret: set {SECRET_ENV} or serve with "
            "--public-metrics; behind a router, name the engines with --metrics-url)"
            if e.code == 401
            else ""
        )
        raise ScrapeError(f"{target} answered HTTP {e.code}{hint}") from e
    except (urllib.error.URLError, OSError) as e:
        raise ScrapeError(f"cannot reach {target}: {getattr(e, 'reason', e)}") from e


def _get(target: str, headers: dict[str, str], timeout_s: float) -> str:
    with urllib.request.urlopen(
        urllib.request.Request(target, None, headers), timeout=timeout_s
    ) as r:
        return r.read().decode("utf-8", errors="replace")


def scrape(urls: Sequence[str], parse: Callable[[str], C | None] = parse_spec_counters) -> C | None:
    """The counters `parse` reads, of all `urls` summed; None when none of them has any."""
    found = [c for url in urls if (text := fetch_metrics(url)) and (c := parse(text))]
    return sum(found[1:], found[0]) if found else None


def spec_summary(delta: SpecCounters) -> dict[str, Any]:
    """A run's counts for the report: the mean accepted length per verification step (1 +
    accepted / drafts), the acceptance rate of draft tokens, and per position the share of drafts
    whose token there was accepted (a draft shorter than the position counts as not accepted
    there, as in vLLM). The ratios are None (the list empty) when no draft was verified."""
    drafts = round(delta.drafts)
    per_pos = [a / delta.drafts for a in delta.accepted_per_pos] if drafts else []
    return {
        "scope": SCOPE,
        "drafts": drafts,
        "draft_tokens": round(delta.draft_tokens),
        "accepted_tokens": round(delta.accepted_tokens),
        MEAN_ACCEPTED: 1.0 + delta.accepted_tokens / delta.drafts if drafts else None,
        "acceptance_rate": delta.accepted_tokens / delta.draft_tokens
        if delta.draft_tokens
        else None,
        "acceptance_rate_per_position": per_pos,
    }


class CounterProbe(Generic[C]):
    """Counters read from the servers' /metrics before a run (`start`) and after it (`finish`),
    their difference summed up by `summary`; a scrape that fails is said once per reason, and
    that run then reports nothing. A subclass names what it counts (`what`), how to read it from
    a Prometheus text (`parse`) and how to sum it up (`summary`)."""

    what: str

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.before: C | None = None
        self.warned: set[str] = set()

    def parse(self, text: str) -> C | None:
        raise NotImplementedError

    def summary(self, delta: C) -> dict[str, Any]:
        raise NotImplementedError

    def start(self) -> None:
        self.before = self._read()

    def finish(self) -> dict[str, Any] | None:
        """`summary` of what the run counted; None when not measured."""
        after = self._read()
        if self.before is None or after is None:
            return None
        delta = after.since(self.before)
        if delta is None:
            self._warn("its counters went back during the run (a server restarted)")
            return None
        return self.summary(delta)

    def _read(self) -> C | None:
        try:
            return scrape(self.urls, self.parse)
        except ScrapeError as e:
            self._warn(str(e))
            return None

    def _warn(self, why: str) -> None:
        if why not in self.warned:
            self.warned.add(why)
            warn(f"{self.what} is not reported: {why}")


class SpecProbe(CounterProbe[SpecCounters]):
    """Speculative decoding's counters over a run (`spec_summary`)."""

    what = "speculative decoding"

    def parse(self, text: str) -> SpecCounters | None:
        return parse_spec_counters(text)

    def summary(self, delta: SpecCounters) -> dict[str, Any]:
        return spec_summary(delta)
