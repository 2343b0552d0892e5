"""Property tests: random add / step / abort / finish sequences never leak or double-free a block,
and requests that share a prefix share its blocks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ember.kv.kv_cache_manager import KVCacheManager
from ember.sampling_params import SamplingParams

BLOCK = 4
EOS = 0


def make_request(rid: str, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(rid, prompt, params, frozenset({EOS}), max_tokens=max_tokens)


def check_invariants(s: Scheduler) -> None:
    kv, pool = s.kv, s.kv.pool
    held: Counter[int] = Counter()
    for rid, req in s.requests.items():
        ids = kv.block_ids(rid)
        assert len(ids) == len(set(ids)), "a block appears twice in one block table"
        held.update(ids)
        if req.status == RequestStatus.RUNNING:
            assert len(ids) * BLOCK >= req.num_computed_tokens
        else:
            assert ids == [], "a waiting request holds blocks"
    for b in pool.blocks:
        assert b.ref_cnt == held[b.block_id], (
            f"block {b.block_id} ref {b.ref_cnt} != {held[b.block_id]}"
        )
        # A free block is in exactly one of the pool's two free sets; held ones in neither.
        plain, cached = b.block_id in pool._plain, pool.policy.holds(b.block_id)
        assert (b.ref_cnt == 0) == (plain or cached) and not (plain and cached)
    assert pool.num_free_blocks == sum(b.ref_cnt == 0 for b in pool.blocks)
    for h, b in pool._cached.items():
        assert b.block_hash == h
    assert not (set(kv._blocks) - set(s.requests)), "blocks held by a request the scheduler forgot"


def run_step(s: Scheduler, rng: random.Random) -> None:
    Stepper(s, rng).step()


class Stepper:
    """Schedules steps and feeds their sampled tokens back; with `lag`, one step later, as async
    scheduling does (step N+1 is scheduled before step N's tokens are known)."""

    def __init__(self, s: Scheduler, rng: random.Random, lag: bool = False) -> None:
        self.s, self.rng, self.lag = s, rng, lag
        self.pending: tuple[SchedulerOutput, list[int | None]] | None = None

    @property
    def busy(self) -> bool:
        return self.s.has_unfinished_requests() or self.pending is not None

    def step(self) -> None:
        s = self.s
        out = s.schedule()
        total = sum(out.num_scheduled_tokens)
        assert total <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        sampled: list[int | None] = []
        for req, n, start, samples in zip(
            out.requests,
            out.num_scheduled_tokens,
            out.num_computed_tokens,
            out.samples,
            strict=True,
        ):
            assert n >= 1
            assert req.num_computed_tokens == start + n
            unknown = start + n - req.num_tokens  # inputs whose token is still in flight
            assert unknown <= 1 and (unknown <= 0 or n == 1), "scheduled past the known tokens"
            if not self.lag:
                assert unknown <= 0
            sampled.append(self.rng.randrange(1, 50) if samples else None)
        if not self.lag:
            s.update_from_output(out, sampled)
            return
        if self.pending is not None:
            s.update_from_output(*self.pending)
        self.pending = (out, sampled) if out.requests else None


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("stop"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(12, 40),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    seed=st.integers(0, 2**16),
    lag=st.booleans(),
)
def test_random_operations_never_leak_blocks(ops, num_blocks, budget, max_seqs, caching, seed, lag):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    s = Scheduler(SchedulerConfig(max_seqs, budget, max_model_len=num_blocks * BLOCK), kv)
    stepper = Stepper(s, rng, lag)
    prefixes = [[rng.randrange(1, 50) for _ in range(20)] for _ in range(4)]
    n = 0
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, prefix = op
            prompt = (prefixes[prefix] + [rng.randrange(1, 50) for _ in range(plen)])[: plen + 8]
            prompt = prompt[: s.config.max_model_len - 1]
            s.add_request(make_request(str(n), prompt, max_tokens))
            n += 1
        elif op[0] == "step":
            stepper.step()
        else:
            live = list(s.requests)
            if live:
                rid = live[op[1] % len(live)]
                status = (
                    RequestStatus.FINISHED_ABORTED
                    if op[0] == "abort"
                    else RequestStatus.FINISHED_STOPPED
                )
                s.finish_requests([rid], status)
        check_invariants(s)
    # Drain: everything finishes (no deadlock) and every block comes back.
    for _ in range(10_000):
        if not stepper.busy:
            break
        stepper.step()
        check_invariants(s)
    assert not stepper.busy, "scheduler stalled"
    assert kv.pool.num_free_blocks == num_blocks


def test_shared_prefix_reuses_blocks() -> None:
    kv = KVCacheManager(32, BLOCK)
    s = Scheduler(SchedulerConfig(8, 64, 128), kv)
    prefix = list(range(1, 13))  # three full blocks
    a = make_request("a", prefix + [40, 41], 4)
    s.add_request(a)
    run_step(s, random.Random(0))
    b = make_request("b", prefix + [42], 4)
    s.add_request(b)
    run_step(s, random.Random(0))
    assert b.num_cached_tokens == 12
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in kv.block_ids("a")[:3])


def test_full_hit_still_computes_last_token() -> None:
    kv = KVCacheManager(32, BLOCK)
    s = Scheduler(SchedulerConfig(8, 64, 128), kv)
    prompt = list(range(1, 9))  # exactly two blocks
    s.add_request(make_request("a", prompt, 1))
    run_step(s, random.Random(0))
    assert not s.has_unfinished_requests()
    b = make_request("b", prompt, 1)
    s.add_request(b)
    out = s.schedule()
    assert b.num_cached_tokens == 4 and out.num_scheduled_tokens == [4]


def test_chunked_prefill_respects_budget_and_decodes_go_first() -> None:
    kv = KVCacheManager(64, BLOCK)
    s = Scheduler(SchedulerConfig(8, 10, 256), kv)
    s.add_request(make_request("d", [1, 2, 3], 5))
    rng = random.Random(0)
    run_step(s, rng)  # "d" prefilled and sampled once
    s.add_request(make_request("p", list(range(1, 30)), 2))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["d", "p"]
    assert out.num_scheduled_tokens == [1, 9]


@pytest.mark.parametrize("lag", [False, True], ids=["sync", "async"])
def test_preemption_by_recompute_when_blocks_run_out(lag: bool) -> None:
    kv = KVCacheManager(6, BLOCK, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(4, 64, 24), kv)
    stepper = Stepper(s, random.Random(0), lag)
    a = make_request("a", list(range(1, 9)), 12)
    b = make_request("b", list(range(11, 19)), 12)
    s.add_request(a)
    s.add_request(b)
    for _ in range(200):
        if not stepper.busy:
            break
        stepper.step()
        check_invariants(s)
    assert s.num_preemptions > 0
    assert kv.pool.num_free_blocks == 6
    assert a.num_output_tokens == b.num_output_tokens == 12  # nothing lost to the preemption


def test_async_steps_stop_at_max_tokens_and_drop_tokens_past_a_stop() -> None:
    kv = KVCacheManager(32, BLOCK)
    s = Scheduler(SchedulerConfig(4, 64, 128), kv)
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=3), frozenset({EOS}), max_tokens=3)
    s.add_request(req)
    first = s.schedule()  # prefill: samples output 1
    second = s.schedule()  # scheduled on output 1 while it is in flight
    assert second.num_scheduled_tokens == [1] and req.num_output_placeholders == 2
    s.update_from_output(first, [9])
    third = s.schedule()
    s.update_from_output(second, [10])
    # Outputs 1..3 are known or in flight: max_tokens=3 allows no fourth step.
    assert s.schedule().is_empty
    s.update_from_output(third, [11])
    assert req.output_token_ids == [9, 10, 11] and req.status == RequestStatus.FINISHED_LENGTH
    assert kv.pool.num_free_blocks == 32

    eos = Request("b", [5, 6, 7], SamplingParams(max_tokens=8), frozenset({EOS}), max_tokens=8)
    s.add_request(eos)
    first, second = s.schedule(), s.schedule()
    s.update_from_output(first, [EOS])  # stops; the step in flight computed one token too many
    s.update_from_output(second, [12])
    assert eos.output_token_ids == [EOS] and eos.status == RequestStatus.FINISHED_STOPPED
    assert kv.pool.num_free_blocks == 32


def test_prompt_too_long_is_rejected_with_a_clear_message() -> None:
    s = Scheduler(SchedulerConfig(4, 64, 16), KVCacheManager(8, BLOCK))
    with pytest.raises(ValueError, match="max_model_len is 16"):
        s.add_request(make_request("x", list(range(1, 17)), 1))
