"""The KV cache of a data-parallel attention engine: each request placed on one rank (where its
prefix is cached, else where there is room), its block ids in that rank's run, preemption
choosing a request of the same rank; and each rank's share of a step."""

from __future__ import annotations

import numpy as np

from ember.engine.dp_attention import DataParallelShare
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler, SchedulerConfig
from ember.engine.step_plan import EagerInputs
from ember.kv.block_hash import BlockHash
from ember.kv.data_parallel import DataParallelKV
from ember.sampling_params import SamplingParams

BS = 4


def admit(kv: DataParallelKV, rid: str, tokens: list[int]) -> tuple[int, list[BlockHash]]:
    """Look up, allocate and publish a whole prompt as the scheduler does; its rank."""
    hashes: list[BlockHash] = []
    hits, n = kv.get_computed_blocks(hashes, tokens, None, rid)
    assert kv.allocate_slots(rid, 0, len(tokens) - n, hits)
    kv.publish(rid, hashes, tokens, None, len(tokens))
    r = kv.rank_of(rid)
    assert r is not None
    return r, hashes


def test_requests_spread_over_the_ranks_and_ids_name_their_rank() -> None:
    kv = DataParallelKV(2, 8, BS)
    ranks = [admit(kv, f"r{i}", list(range(100 * i, 100 * i + 9)))[0] for i in range(4)]
    assert sorted(ranks) == [0, 0, 1, 1]
    for i, r in enumerate(ranks):
        ids = kv.block_ids(f"r{i}")
        assert len(ids) == 3
        assert all(r * 8 <= b < (r + 1) * 8 for b in ids)
    assert kv.pool.num_free_blocks == 16 - 12
    assert abs(kv.usage - 12 / 16) < 1e-9


def test_a_prefix_brings_a_request_back_to_its_rank() -> None:
    kv = DataParallelKV(2, 16, BS)
    convo = list(range(12))
    r, _ = admit(kv, "turn1", convo)
    kv.free("turn1")
    admit(kv, "other", list(range(500, 509)))  # fills the other rank a little, not this one
    r2, _ = admit(kv, "turn2", convo + [7, 7, 7, 7, 7])
    assert r2 == r
    assert kv.ranks[r].pool.num_cached_blocks >= 3
    assert kv.block_ids("turn2")[:2] == [r * 16 + b for b in kv.ranks[r].block_ids("turn2")[:2]]


def test_a_full_rank_refuses_though_another_has_room() -> None:
    kv = DataParallelKV(2, 4, BS)
    admit(kv, "a", list(range(13)))  # 4 blocks: rank 0 full
    assert kv.rank_of("a") == 0
    # b placed on rank 1 (the room); growing a needs its own rank's room, which is gone.
    admit(kv, "b", list(range(50, 55)))
    assert kv.rank_of("b") == 1
    assert not kv.allocate_slots("a", 13, 4)
    assert kv.allocate_slots("b", 5, 4)
    assert kv.shares_room("a", "a") and not kv.shares_room("a", "b")
    kv.free("a")
    assert kv.rank_of("a") is None and kv.block_ids("a") == []
    assert kv.pool.num_free_blocks == 4 + 4 - 3


def test_preemption_takes_a_request_of_the_same_rank() -> None:
    kv = DataParallelKV(2, 4, BS)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=16), kv)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # 3 blocks on rank 0, 3 on rank 1, then 1 and 1: both ranks full.
    for i, n in enumerate((12, 11, 4, 3)):
        s.add_request(Request(f"r{i}", list(range(100 * i, 100 * i + n)), params, frozenset(), 8))
    out = s.schedule()
    assert [kv.rank_of(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    s.update_from_output(out, [1] * 4)
    # r0's next token needs a 4th block on rank 0: r2 gives way, not r3 (the last running, whose
    # blocks are on rank 1), and no one else needs room.
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["r2"]
    assert [r.request_id for r in out.requests] == ["r0", "r1", "r3"]


def test_a_rank_takes_its_requests_rows_in_its_own_block_ids() -> None:
    # Three requests: a decode on rank 1, a decode on rank 0, a 3-token chunk on rank 1.
    e = EagerInputs(
        input_ids=[1, 2, 3, 4, 5],
        positions=[4, 1, 5, 6, 7],
        slots=[8 * 4 + 0, 1, 9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3],
        query_start_loc=[0, 1, 2, 5],
        seq_lens=[5, 2, 8],
        block_tables=[[10, 8], [0], [12, 9]],
        max_query_len=3,
        num_decodes=2,
    )
    own, rows = DataParallelShare(1, 8, BS).own_rows(e)
    assert rows == [0, 2, 3, 4]
    assert own.slots == [0, 5, 6, 7]
    assert own.block_tables == [[2, 0], [4, 1]]
    assert own.query_start_loc == [0, 1, 4]
    assert own.seq_lens == [5, 8]
    assert (own.num_decodes, own.max_query_len) == (1, 3)
    own0, rows0 = DataParallelShare(0, 8, BS).own_rows(e)
    assert rows0 == [1]
    assert own0.slots == [1] and own0.block_tables == [[0]] and own0.num_decodes == 1
    none, rows2 = DataParallelShare(2, 8, BS).own_rows(e)
    assert rows2 == [] and none.block_tables == []


def test_a_rank_takes_its_rows_of_a_decode_graph() -> None:
    # fill_rows' layout: a decode on rank 1, a 2-row verification on rank 0, a decode on rank
    # 1, then a padding row; blocks of 4 tokens, 8 a rank.
    rows = np.array(
        [
            [5, 6, 7, 8, 0],  # input ids
            [4, 1, 2, 9, 0],  # positions
            [8 * 4 + 0, 1, 2, 12 * 4 + 1, -1],  # slots
            [5, 2, 3, 10, 1],  # context lengths
            [-1, -1, -1, -1, -1],  # feed rows
            [1, 2, 0, 1, 1],  # row groups
        ],
        dtype=np.int64,
    )
    tables = np.array([[10, 8, 99], [0, 0, 99], [0, 0, 99], [14, 12, 99], [0, 0, 99]], np.int32)
    share = DataParallelShare(1, 8, BS)
    foreign = share.localize(rows, tables, used=4, size=5, width=2)
    assert foreign.tolist() == [False, True, True, False, True]
    assert rows[0].tolist() == [5, 6, 7, 8, 0] and rows[1].tolist() == [4, 1, 2, 9, 0]
    assert rows[2].tolist() == [0, -1, -1, 4 * 4 + 1, -1]
    assert rows[3].tolist() == [5, 1, 1, 10, 1]
    assert rows[5].tolist() == [1, 1, 1, 1, 1]
    assert tables[:, :2].tolist() == [[2, 0], [0, 0], [0, 0], [6, 4], [0, 0]]
    assert tables[:, 2].tolist() == [99] * 5  # past the used width: untouched


def test_rank_zero_keeps_its_verification_rows() -> None:
    rows = np.array(
        [[1, 2, 3], [4, 5, 6], [17, 18, 8 * 4 + 3], [5, 6, 7], [-1] * 3, [2, 0, 1]], np.int64
    )
    tables = np.array([[4, 3], [4, 3], [8, 0]], np.int32)
    foreign = DataParallelShare(0, 8, BS).localize(rows, tables, used=3, size=3, width=2)
    assert foreign.tolist() == [False, False, True]
    assert rows[2].tolist() == [17, 18, -1] and rows[5].tolist() == [2, 0, 1]
    assert tables.tolist() == [[4, 3], [4, 3], [0, 0]]
