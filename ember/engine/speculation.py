"""The engine's side of speculative decoding: which requests speculate this step, their drafts
from a host proposer (n-gram, suffix), and the counters of how the drafts fared.

A speculating request's drafts are made from its known tokens, so its steps are not scheduled
ahead of their tokens (`Request.needs_known_tokens`): while any request speculates, the engine
collects each step before scheduling the next. When the batch is large, verification costs more
than it saves; the engine then stops speculating (`SpeculativeConfig.max_batch`, or on a GPU the
step times it measures, `StepCosts`) and async scheduling resumes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ember.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from ember.engine.request import Request
    from ember.engine.scheduler import SchedulerOutput
    from ember.spec.proposer import HostProposer


class StepCosts:
    """Measured step periods with and without verification, by batch size (powers of two), and
    the tokens a verifying request gets per step: speculation pays at a batch size while
    tokens per request x t(decode step) > t(verify step).

    A size's first step runs without drafts (a plain decode's time is learned first), the next
    with them; from then on the measured decision holds, except that every PROBE_EVERY-th step
    at a size does the opposite, to keep the other side's time fresh (a decision never sticks
    on an old measurement). On an H200 a SmolLM2 step of 64 requests verifying 4 drafts each
    took 18-46 ms against 2.8 ms for a plain decode: the engine must learn that within a few
    steps, not after dozens."""

    PROBE_EVERY = 32
    EMA = 0.1

    def __init__(self) -> None:
        self.decode_s: dict[int, float] = {}
        self.verify_s: dict[int, float] = {}
        self.tokens: dict[int, float] = {}
        self._steps: dict[int, int] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()

    def observe(
        self, batch: int, verified: bool, seconds: float, tokens_per_request: float
    ) -> None:
        b = self.bucket(batch)
        times = self.verify_s if verified else self.decode_s
        times[b] = self._ema(times.get(b), seconds)
        if verified:
            self.tokens[b] = self._ema(self.tokens.get(b), tokens_per_request)

    def worth_it(self, batch: int) -> bool:
        b = self.bucket(batch)
        self._steps[b] = self._steps.get(b, 0) + 1
        dec, ver, tok = self.decode_s.get(b), self.verify_s.get(b), self.tokens.get(b)
        if dec is None:
            return False
        if ver is None or tok is None:
            return True
        decision = tok * dec > ver
        if self._steps[b] % self.PROBE_EVERY == 0:
            return not decision
        return decision

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.EMA * (new - old)


class Speculator:
    def __init__(self, config: SpeculativeConfig, measure: bool) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.host: HostProposer | None = None
        if config.method in ("ngram", "suffix"):
            from ember.spec.host import make_host_proposer

            self.host = make_host_proposer(config.method, self.k)
        self.costs = StepCosts() if measure and config.max_batch is None else None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self._last_step_end = 0.0  # perf_counter() at the last collected step
        self._began = 0.0  # perf_counter() when the engine's current step began (plan)

    def add_request(self, req: Request) -> None:
        if self.host is not None:
            self.host.add_request(req.request_id, req.prompt_token_ids, req.cache_salt)

    def finish(self, req: Request) -> None:
        if self.host is not None:
            self.host.finish(req.request_id, req.output_token_ids)

    def plan(self, running: list[Request]) -> None:
        """Decide who speculates in the next step (before the engine decides whether to wait)."""
        self._began = time.perf_counter()
        on = self._enabled(len(running))
        for r in running:
            r.speculates = on and r.sampling_params.speculative
            if not r.speculates:
                r.spec_token_ids = []

    def propose(self, running: list[Request]) -> None:
        """Drafts for the speculating requests that decode next step with their tokens known."""
        if self.host is None:
            return
        for r in running:
            if (
                r.speculates
                and r.num_output_tokens
                and not r.num_output_placeholders
                and r.num_computed_tokens == r.num_tokens - 1
            ):
                r.spec_token_ids = self.host.propose(r.request_id, r.all_token_ids, self.k)

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

    def record_step(
        self, so: SchedulerOutput, accepted: list[list[int]], launched_at: float
    ) -> None:
        """Count a collected step's drafts, and feed its period to the cost model: from the
        previous step's end, or from the start of the engine step that launched it if that came
        later (idle time is no step's). A step collected before the next is scheduled (a
        verification) thus counts the host's planning, proposing and scheduling before its launch,
        which it does not overlap; an async step's period is end to end."""
        now = time.perf_counter()
        period = now - max(min(launched_at, self._began), self._last_step_end)
        self._last_step_end = now
        tokens = verified = 0
        for i, req in enumerate(so.requests):
            drafts = so.spec_token_ids[i] if so.spec_token_ids else []
            if drafts:
                n = len(accepted[i]) if accepted else 0
                self.record(req, drafts, n)
                verified += 1
                tokens += n + 1
        if self.costs is None:
            return
        decodes = sum(1 for n in so.num_scheduled_tokens if n == 1)
        if verified and verified + decodes == len(so.requests):
            self.costs.observe(
                len(so.requests), True, period, (tokens + decodes) / len(so.requests)
            )
        elif decodes and decodes == len(so.requests):
            self.costs.observe(decodes, False, period, 1.0)

    def stats(self) -> dict[str, int | list[int]]:
        """The counters, as SchedulerStats' fields."""
        return {
            "spec_drafts": self.num_drafts,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_pos": list(self.accepted_per_pos),
        }

    def _enabled(self, batch: int) -> bool:
        if self.config.max_batch is not None:
            return batch <= self.config.max_batch
        return self.costs is None or self.costs.worth_it(batch)
