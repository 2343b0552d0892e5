"""The engine's side of speculative decoding: which requests speculate this step, their drafts
from a host proposer (n-gram, suffix), and the counters of how the drafts fared.

A speculating request's drafts are made from its known tokens, so its steps are not scheduled
ahead of their tokens (`Request.needs_known_tokens`): while any request speculates, the engine
collects each step before scheduling the next. When the batch is large, verification costs more
than it saves; the engine then stops speculating (`SpeculativeConfig.max_batch`, or on a GPU the
output rates it measures, `StepCosts`) and async scheduling resumes.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from ember.spec_decode.config import DEFAULT_MAX_BATCH, SpeculativeConfig

if TYPE_CHECKING:
    from ember.engine.request import Request
    from ember.engine.scheduler import SchedulerOutput
    from ember.spec_decode.proposer import HostProposer


def verify_graph_rows(config: SpeculativeConfig, max_graph_batch: int) -> int:
    """The most rows a verify batch can have on a GPU: (k + 1) a request, for no more requests
    than the graphs' batch or the bound past which the engine never speculates (its
    `max_batch`, else DEFAULT_MAX_BATCH). Verify graphs past the decode sizes stop there."""
    bound = config.max_batch if config.max_batch is not None else DEFAULT_MAX_BATCH
    return min(max_graph_batch, bound) * (config.num_speculative_tokens + 1)


class StepCosts:
    """Output tokens per second with and without speculation, by batch size (powers of two),
    each over the last SAMPLES counted steps of its mode: speculation holds at a size while its
    rate beats plain decoding's.

    Rates, not step times: what a verification gains (tokens per request per step, over the
    requests that drafted and those that did not) and what it costs (a longer GPU step, the lost
    async overlap, the host's proposing) are both in its tokens per second. A size's first
    WINDOW steps decode plainly; then it speculates until MIN_SPEC steps of speculation are
    counted; from then on the faster mode holds, except for a window of the other mode every
    PROBE_EVERY steps (a decision never sticks on an old measurement). A window's first step is
    a transition (a plain step after a verification has no async overlap yet) and is not
    counted. On an H200 at batch 64, SmolLM2 made 41 tokens a step in 2.8 ms plainly and 61 a
    step in 6.6 ms speculating: 14.4k against 9.3k tokens/s, which an earlier model comparing
    step times with per-draft acceptance got the wrong way.

    Many samples, not a few: how many drafts stand varies along an answer (an agent's tool call
    starts where no draft fits, then quotes its prompt). Deciding on the 3 counted steps of a
    window, and re-deciding on a probe's 3 every 64 steps, turned speculation off for most of
    each answer at batch 1 (on an H100 the same run gave 2.20x one time and 1.54x the next). A
    period OUTLIER times off its mode's mean (a host hiccup; the step an async pipeline hands
    over at once when it drains, ~0 s) is no sample unless the next one is off too: a drained
    plain step at each switch to speculation had pulled plain's mean period down."""

    PROBE_EVERY = 64
    WINDOW = 4
    MIN_SPEC = 12
    SAMPLES = 32
    OUTLIER = 4.0

    def __init__(self) -> None:
        self._samples: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        """(bucket, speculating) -> the last SAMPLES counted steps' tokens and periods."""
        self._steps: dict[int, int] = {}
        self._last: dict[int, bool] = {}
        self._off: set[tuple[int, bool]] = set()
        """Modes whose last period was an outlier."""

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()

    def observe(
        self, batch: int, speculating: bool, seconds: float, tokens: int, counted: bool = True
    ) -> None:
        """One all-decode step's period and output tokens; a mode's first step is not counted,
        nor one with `counted` False (it only sets the mode the next step follows)."""
        b = self.bucket(batch)
        transition = self._last.get(b) is not speculating
        self._last[b] = speculating
        if transition or not counted or seconds <= 0:
            return
        key = (b, speculating)
        samples = self._samples.setdefault(key, deque(maxlen=self.SAMPLES))
        if samples:
            mean = self.totals(key)[1] / len(samples)
            if not mean / self.OUTLIER <= seconds <= mean * self.OUTLIER and key not in self._off:
                self._off.add(key)
                return
        self._off.discard(key)
        samples.append((tokens, seconds))

    def totals(self, key: tuple[int, bool]) -> tuple[int, float]:
        """Tokens and seconds over the samples of (bucket, speculating)."""
        samples = self._samples.get(key, ())
        return sum(t for t, _ in samples), sum(s for _, s in samples)

    @property
    def rate(self) -> dict[int, dict[bool, float]]:
        """bucket -> {speculating: tokens per second}: the sum of the samples' tokens over the
        sum of their periods (not a mean of per-step rates, which short lucky verifications
        would pull up)."""
        out: dict[int, dict[bool, float]] = {}
        for b, mode in self._samples:
            r = self._rate(b, mode)
            if r is not None:
                out.setdefault(b, {})[mode] = r
        return out

    def _rate(self, b: int, speculating: bool) -> float | None:
        tokens, seconds = self.totals((b, speculating))
        return tokens / seconds if seconds > 0 else None

    def worth_it(self, batch: int) -> bool:
        """Whether the next step at this batch size speculates."""
        b = self.bucket(batch)
        n = self._steps.get(b, 0)
        self._steps[b] = n + 1
        if n < self.WINDOW:
            return False  # learn plain decoding first
        plain, spec = self._rate(b, False), self._rate(b, True)
        if plain is None:
            return False
        if spec is None or len(self._samples[(b, True)]) < self.MIN_SPEC:
            return True  # then speculation, on enough steps to tell
        decision = spec > plain
        if n % self.PROBE_EVERY >= self.PROBE_EVERY - self.WINDOW:
            return not decision
        return decision


class Speculator:
    MAX_BACKOFF = 16
    """The most steps a request sits out of speculation after host proposals that missed."""

    def __init__(self, config: SpeculativeConfig, measure: bool) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.host: HostProposer | None = None
        host_method = config.hybrid if config.method == "eagle3" else config.method
        if host_method is not None:
            from ember.spec_decode.host import make_host_proposer

            self.host = make_host_proposer(host_method, self.k)
        self.hybrid = config.method == "eagle3" and self.host is not None
        """EAGLE-3 with a host proposer beside it: each request's drafts from the one expected
        to have more stand (`choose_host`)."""
        self.host_draft_tokens = self.host_accepted_tokens = 0
        self.head_drafts = self.head_accepted_tokens = 0
        self.host_chosen = 0
        """Hybrid: the counts by source, and the proposals the host proposer won."""
        self.costs = StepCosts() if measure and config.max_batch is None else None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self._last_step_end: float | None = None  # perf_counter() at the last collected step

    def add_request(self, req: Request) -> None:
        if self.host is not None:
            self.host.add_request(req.request_id, req.prompt_token_ids, req.cache_salt)

    def finish(self, req: Request) -> None:
        """The proposer forgets the request; its output joins the proposer's shared state (the
        suffix method's tenant cache) only if the engine speculated for it: a busy server with
        speculation off spends no host time on proposer bookkeeping."""
        if self.host is not None:
            self.host.finish(req.request_id, req.output_token_ids if req.speculated else [])

    def plan(self, running: list[Request]) -> None:
        """Decide who speculates in the next step (before the engine decides whether to wait)."""
        if not running:  # idle: the next step's period starts at its launch
            self._last_step_end = None
        on = self._enabled(len(running))
        # EAGLE-3's head grows its KV after every step of a speculative request, speculating or
        # not; past the bound (where no step speculates) it does not, and those requests stop.
        stale = self.config.method == "eagle3" and self._past_bound(len(running))
        for r in running:
            if stale:
                r.spec_stale = True
            wants = on and r.sampling_params.speculative and not r.spec_stale
            if wants and r.spec_backoff > 0:  # sits this step out: it may run async
                r.spec_backoff -= 1
                wants = False
            r.speculates = wants
            if wants:
                r.speculated = True
            else:
                r.spec_token_ids = []
                r.spec_from_host = False

    def propose(self, running: list[Request]) -> None:
        """Drafts for the speculating requests that decode next step with their tokens known
        (hybrid: the host proposer's in place of the head's where they are expected to do
        better)."""
        if self.host is None:
            return
        for r in running:
            if (
                r.speculates
                and r.num_output_tokens
                and not r.num_output_placeholders
                and r.num_computed_tokens == r.num_tokens - 1
            ):
                drafts = self.host.propose(r.request_id, r.all_token_ids, self.k)
                if self.hybrid:
                    r.spec_from_host = self.choose_host(r, drafts)
                    if r.spec_from_host:
                        r.spec_token_ids = drafts
                        self.host_chosen += 1
                    continue
                r.spec_token_ids = drafts
                if not r.spec_token_ids:
                    self._missed(r)

    HEAD_PRIOR = 0.5
    """Hybrid: the head's expected accepted tokens a draft, as a share of K, until MEASURED of
    its drafts are counted (published EAGLE-3 heads keep 2-3.5 of 4 on chat)."""
    HOST_PRIOR = 0.5
    """Hybrid, a host proposer with no estimate of its own (ngram): the share of its draft
    tokens expected to stand until MEASURED of them are counted."""
    MEASURED = 16

    def choose_host(self, r: Request, drafts: list[int]) -> bool:
        """Whether request `r` verifies the host proposer's `drafts` rather than the head's
        (`r.spec_token_ids`): the host's expected accepted tokens (its own estimate, else its
        measured rate times the drafts) beat the head's measured mean a draft."""
        if not drafts:
            return False
        if not r.spec_token_ids:
            return True  # the head drafted nothing this step
        if self.head_drafts >= self.MEASURED:
            head = self.head_accepted_tokens / self.head_drafts
        else:
            head = self.HEAD_PRIOR * self.k
        own = self.host.expected_accepted(r.request_id) if self.host is not None else None
        if own is None:
            rate = self.HOST_PRIOR
            if self.host_draft_tokens >= self.MEASURED:
                rate = self.host_accepted_tokens / self.host_draft_tokens
            own = rate * len(drafts)
        return own > head

    def record(self, req: Request, drafts: list[int], accepted: int) -> None:
        if not drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        req.spec_draft_tokens += len(drafts)
        req.spec_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        if self.config.method != "eagle3" or req.spec_from_host:
            self.host_draft_tokens += len(drafts)
            self.host_accepted_tokens += accepted
        else:
            self.head_drafts += 1
            self.head_accepted_tokens += accepted
        if self.host is not None and not self.hybrid:
            if accepted:
                req.spec_misses = 0
            else:
                self._missed(req)

    def _missed(self, req: Request) -> None:
        """A host proposal that gave nothing (no draft, or none stood): the request sits out
        the next 1, 2, 4 .. MAX_BACKOFF steps while it keeps missing. Its steps then run async
        (a speculating step waits for the previous one's tokens), so text the proposer cannot
        predict (free prose) decodes at the plain rate, and one hit brings speculation back."""
        req.spec_misses += 1
        req.spec_backoff = min(1 << (req.spec_misses - 1), self.MAX_BACKOFF)

    def record_step(
        self, so: SchedulerOutput, accepted: list[list[int]], launched_at: float
    ) -> None:
        """Count a collected step's drafts, and feed its period and output tokens to the cost
        model. The period runs from the previous step's end, whatever came between (an async
        step overlaps the host work of the next, a speculating one does not), or from its launch
        after idle time (a new request's first step is a prefill, which no rate counts)."""
        now = time.perf_counter()
        last, self._last_step_end = self._last_step_end, now
        period = now - (launched_at if last is None else last)
        tokens = 0
        for i, req in enumerate(so.requests):
            drafts = so.spec_token_ids[i] if so.spec_token_ids else []
            n = len(accepted[i]) if drafts and accepted else 0
            if drafts:
                self.record(req, drafts, n)
            tokens += n + 1
        if self.costs is not None and all(
            n == 1 + len(so.spec_token_ids[i] if so.spec_token_ids else [])
            for i, n in enumerate(so.num_scheduled_tokens)
        ):  # decodes and verifications only: a prefill chunk's time is no decode rate's
            # A speculating step with no draft at all (every proposal came back empty) verified
            # nothing: no sample of what verification costs or gains (the requests' backoff
            # keeps such steps rare), but the next step follows a synchronous one.
            verified = any(so.spec_token_ids) if so.spec_token_ids else False
            counted = verified or not so.speculating
            self.costs.observe(len(so.requests), so.speculating, period, tokens, counted)

    def stats(self) -> dict[str, int | list[int]]:
        """The counters, as SchedulerStats' fields."""
        return {
            "spec_drafts": self.num_drafts,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_pos": list(self.accepted_per_pos),
        }

    def _past_bound(self, batch: int) -> bool:
        """More requests run than the engine ever speculates for (`max_batch`, or on a GPU
        DEFAULT_MAX_BATCH); the CPU has no bound unless given."""
        if self.config.max_batch is not None:
            return batch > self.config.max_batch
        return self.costs is not None and batch > DEFAULT_MAX_BATCH

    def _enabled(self, batch: int) -> bool:
        if self._past_bound(batch):
            return False
        if self.config.max_batch is not None or self.costs is None:  # the bound alone decides
            return True
        return self.costs.worth_it(batch)
