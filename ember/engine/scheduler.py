"""Continuous-batching scheduler, vLLM-V1 style: a token budget per step, running requests first
(decodes and unfinished prefill chunks), then new requests, preemption by recompute when full.

Scheduling a step advances each request's `num_computed_tokens` at once and counts the token it will
sample as a placeholder, so the next step can be scheduled while this one still runs on the GPU
(async scheduling); `update_from_output` later fills the placeholder with the real token."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler_loads import KVLoads, TierLoad
from ember.kv.data_parallel import DataParallelKV
from ember.kv.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from ember.engine.kv_connector import KVConnector
    from ember.kv.block_pool import KVBlock
    from ember.kv.tiers import TierManager


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    """Requests in this step's batch, in batch order."""
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    """Each scheduled request's block table, so the model runner needs no view of the KV manager."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Where each request's scheduled tokens start (its computed tokens before this step)."""
    samples: list[bool] = field(default_factory=list)
    """Whether the step reaches the end of a request's tokens and so samples its next one."""
    spec_token_ids: list[list[int]] = field(default_factory=list)
    """Each request's draft tokens, verified by this step after its last known token (empty for
    most); a request with k drafts is scheduled k + 1 tokens and samples k + 1 positions."""
    preempted: list[Request] = field(default_factory=list)
    scores_prompts: bool = False
    """Some unfinished request asked for prompt logprobs: the model runner looks for rows to score
    (without it, a step costs no per-request look)."""
    speculating: bool = False
    """Some request of the step speculates (`Request.speculates`): the step is collected before
    the next is scheduled, drafts or not (the speculation cost model's mode of the step)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler(KVLoads):
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager | DataParallelKV,
        connector: KVConnector | None = None,
        tiers: TierManager | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector
        self.tiers = tiers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        """Requests whose prompt KV is being read: from a prefill engine (decode role) or from
        the KV tiers (host, disk, store)."""
        self.tier_loads: dict[str, TierLoad] = {}
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_queries = 0
        """Prompt tokens looked up in the prefix cache on first admission (vLLM's metric)."""
        self.prefix_hits = 0
        self.num_prompt_scorers = 0
        """Unfinished requests with `prompt_logprobs`."""
        self.num_lookahead_tokens = 0
        """Slots allocated past a speculating request's scheduled tokens: a draft head (EAGLE-3)
        writes its chained drafts' KV there after the step."""
        self.on_finish: Callable[[Request], None] | None = None
        """Called once for every request that ends, however it ends (the speculator's hook)."""
        self.awaiting_lookup = False
        """The last `schedule` held the next waiting request for its store lookup (see
        TierManager.lookup): the engine loop lets the lookup's thread run."""

    # -- admission and removal ---------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_prompt_tokens < 1:
            raise ValueError("prompt must contain at least one token")
        if req.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}, which leaves no room for output"
            )
        self.requests[req.request_id] = req
        self.num_prompt_scorers += req.sampling_params.prompt_logprobs is not None
        self.waiting.append(req)
        self._prefetch(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests from outside (client gone, stop string): frees their blocks."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.connector is not None:
            self._collect_loads()
        if self.tiers is not None:
            self._collect_tier_loads()
        out = SchedulerOutput()
        self.awaiting_lookup = False
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._at_limit(req):  # its last token is in flight; the request ends when it lands
                i += 1
                continue
            ahead = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            drafts = self._drafts(req, ahead, budget)
            num_new = min(ahead + len(drafts), budget)
            scheduled = True
            ahead_slots = self.num_lookahead_tokens if req.speculates else 0
            while not self._allocate(req, num_new, lookahead=ahead_slots):
                if ahead_slots:  # no room to draft ahead: a plain step first
                    ahead_slots = 0
                    continue
                if drafts:  # no room for the drafts: a plain decode before preempting anyone
                    drafts, num_new = [], ahead
                    continue
                victim = self._victim(req)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            self._add(out, req, num_new, drafts)
            budget -= num_new
            i += 1

        # New work only when nothing had to give way this step.
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if req.num_output_placeholders:  # preempted with a token in flight: wait for it
                break
            if self._reads_remote_kv(req):
                if not self._start_load(req):
                    break
                continue
            # A prompt to be scored is computed whole: a cached block's positions have no logits.
            hits, num_hit = ([], 0) if req.scores_prompt else self._computed_blocks(req)
            plan = self._tier_plan(req, len(hits))
            if plan is None:  # its store lookup is still out: the others' steps go on
                self.awaiting_lookup = True
                break
            hit, chosen = plan
            if chosen.num_blocks:
                if not self._start_tier_load(req, hits, chosen.num_blocks):
                    break
                self._tier_decided(req, hit, chosen, len(hits))
                continue
            num_new = min(req.num_tokens - num_hit, budget)
            if not self._allocate(req, num_new, hits):
                break
            self.waiting.popleft()
            self._tier_decided(req, hit, chosen, len(hits))
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self.prefix_queries += req.num_prompt_tokens
                self.prefix_hits += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add(out, req, num_new)
            budget -= num_new
        out.block_ids = [self.kv.block_ids(r.request_id) for r in out.requests]
        out.scores_prompts = self.num_prompt_scorers > 0
        out.speculating = any(r.speculates for r in out.requests)
        return out

    def _allocate(
        self,
        req: Request,
        num_new: int,
        hits: list[KVBlock] | None = None,
        publish: bool = True,
        lookahead: int = 0,
    ) -> bool:
        """Blocks for `num_new` tokens (and `lookahead` slots more, never published) after the
        computed ones and the hits; False if full.

        Blocks that the step will fill completely are published in the prefix index at once: their
        KV is written before any attention reads it within the same forward pass. Blocks filled
        some other way (read from a remote engine or a tier) pass publish=False and are published
        once written.
        """
        if not self.kv.allocate_slots(
            req.request_id, req.num_computed_tokens, num_new + lookahead, hits
        ):
            return False
        if publish:
            hit_tokens = len(hits) * self.kv.block_size if hits else 0
            self._publish(req, req.num_computed_tokens + hit_tokens + num_new)
        return True

    def _victim(self, req: Request) -> Request:
        """Whom to preempt for `req`'s room: the last running request whose blocks share it
        (with data-parallel attention, one on its rank), at worst `req` itself."""
        for k in range(len(self.running) - 1, -1, -1):
            if self.kv.shares_room(self.running[k].request_id, req.request_id):
                return self.running.pop(k)
        raise RuntimeError(f"request {req.request_id} is not running")

    def _publish(self, req: Request, num_tokens: int) -> None:
        self.kv.publish(
            req.request_id, req.block_hashes, req.all_token_ids, req.cache_salt, num_tokens
        )

    def _drafts(self, req: Request, ahead: int, budget: int) -> list[int]:
        """The drafts this step verifies for a decoding request: at most what the token budget,
        max_tokens and the context length leave after the token it samples anyway."""
        if (
            not req.spec_token_ids
            or ahead != 1
            or req.num_output_placeholders
            or not req.num_output_tokens  # the first token comes from the prompt's own step
        ):
            req.spec_token_ids = []
            return []
        room = min(
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        drafts = req.spec_token_ids[: max(room, 0)]
        req.spec_token_ids = []
        return drafts

    def _add(
        self, out: SchedulerOutput, req: Request, num_new: int, drafts: list[int] | None = None
    ) -> None:
        start = req.num_computed_tokens
        samples = start + num_new == req.num_tokens + req.num_output_placeholders + len(
            drafts or ()
        )
        out.spec_token_ids.append(drafts or [])
        req.verifying = bool(drafts)
        out.requests.append(req)
        out.num_scheduled_tokens.append(num_new)
        out.num_computed_tokens.append(start)
        out.samples.append(samples)
        req.num_computed_tokens = start + num_new
        if samples:
            req.num_output_placeholders += 1

    def _at_limit(self, req: Request) -> bool:
        """Tokens in flight already take the request to max_tokens or the context length."""
        ahead = req.num_output_placeholders
        return ahead > 0 and (
            req.num_output_tokens + ahead >= req.max_tokens
            or req.num_tokens + ahead >= self.config.max_model_len
        )

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: list[int | None],
        accepted: list[list[int]] | None = None,
    ) -> tuple[list[Request], list[Request]]:
        """Fill each sampled placeholder with its token; returns (requests that got tokens, those
        that finished).

        `sampled[i]` is the token sampled for `out.requests[i]`, or None for a prefill chunk that
        did not reach the end of its tokens. With speculation, `accepted[i]` are the drafts the
        step accepted, which come before `sampled[i]`; the KV slots of the rejected ones are
        rolled back (the next step overwrites them). The tokens are taken one at a time, so
        EOS, stop ids, a finished grammar or max_tokens end the request inside an accepted run.
        A request preempted since `out` was scheduled still takes its tokens: their KV was
        computed before its blocks could be reused.
        """
        progressed, finished = [], []
        for i, (req, samples, tok) in enumerate(
            zip(out.requests, out.samples, sampled, strict=True)
        ):
            if req.is_finished:  # stopped from outside, or by an earlier token, since scheduling
                continue
            if not samples:
                continue
            if tok is None:
                raise RuntimeError(f"request {req.request_id} was to sample but got no token")
            req.num_output_placeholders -= 1
            req.verifying = False
            drafts = out.spec_token_ids[i] if out.spec_token_ids else []
            taken = accepted[i] if accepted is not None else []
            if len(taken) > len(drafts) or taken != drafts[: len(taken)]:
                raise RuntimeError(f"request {req.request_id}: accepted tokens are not its drafts")
            if drafts and req.status is RequestStatus.RUNNING:
                req.num_computed_tokens -= len(drafts) - len(taken)
            progressed.append(req)
            for t in (*taken, tok):
                req.append_output_token(t)
                status = self._check_stop(req)
                if status is not None:
                    self._remove(req)
                    self._finish(req, status)
                    finished.append(req)
                    break
        return progressed, finished

    # -- internals -----------------------------------------------------------------------------

    def _check_stop(self, req: Request) -> RequestStatus | None:
        tok = req.output_token_ids[-1]
        params = req.sampling_params
        if req.matcher is not None:
            req.matcher.consume_token(tok)
            if req.matcher.is_stopped():  # the grammar is complete (or ended on EOS)
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and tok in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and tok in params.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _remove(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_TIER_KV:
            self._cancel_tier_load(req)
        elif req.status != RequestStatus.WAITING_FOR_REMOTE_KV:  # loads end in _collect_loads
            self.waiting.remove(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KV
        req.status = status
        if self.connector is not None and self._leases(req, status):
            req.kv_transfer = self.connector.hold(req)
        elif not loading:  # a read into a loading request's blocks may still be running
            self.kv.free(req.request_id)
        if self.tiers is not None:
            self.tiers.forget(req.request_id)
            # A use of every block it computed or hit, wherever they lie now: what the tiers'
            # eviction learns each block's reuse from.
            self.tiers.touch(req.block_hashes)
        del self.requests[req.request_id]
        self.num_prompt_scorers -= req.sampling_params.prompt_logprobs is not None
        if self.on_finish is not None:
            self.on_finish(req)

    def _leases(self, req: Request, status: RequestStatus) -> bool:
        """A prefill-role prompt that ended on its length limit waits for its decode engine."""
        return (
            self.connector is not None
            and self.connector.role == "prefill"
            and req.kv_transfer is not None
            and req.kv_transfer.do_remote_decode
            and status == RequestStatus.FINISHED_LENGTH
            and req.num_output_tokens > 0
        )
