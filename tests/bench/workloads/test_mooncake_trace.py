"""Mooncake trace replay: block tokens keyed by hash id, prompts, timing, the ideal prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.bench.workloads import (
    block_tokens,
    ideal_cached_tokens,
    ideal_hit_ratio,
    load_mooncake_trace,
    read_mooncake_rows,
)
from ember.bench.workloads.mooncake import MooncakeRow
from ember.server.protocol import CompletionRequest

# The public traces the repository ships (benchmarks/data/traces/README.md); a missing trace fails
# the test, it does not skip.
TRACES = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "traces"
REAL_TRACE = TRACES / "mooncake_conversation_trace.jsonl"

# (timestamp ms, input_length, output_length, hash_ids) and, by hand, what an ideal cache holds.
ROWS = [
    (0, 1200, 10, [0, 1, 2]),  # blocks of 512, 512, 176: nothing seen yet -> 0
    (100, 1300, 20, [0, 1, 3]),  # [0], [0, 1] seen; [0, 1, 3] new -> 1024
    (250, 1400, 30, [0, 9, 1]),  # [0] seen; [0, 9] new, so block 1 after it doesn't count -> 512
    (1000, 1100, 40, [0, 1, 2]),  # [0, 1] full; block 2 partial here (76) and seen with 176 -> 1100
    (1500, 1536, 50, [0, 1, 2]),  # block 2 full here, but only 176 of it were ever seen -> 1200
    (2000, 300, 60, [5]),  # a new first block -> 0
]
IDEAL = [0, 1024, 512, 1100, 1200, 0]


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
        for t, n, o, h in rows
    ]
    lines.insert(2, "")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "trace.jsonl", ROWS)


@given(st.integers(0, 2**40))
def test_equal_hash_ids_give_equal_blocks(hash_id: int) -> None:
    block = block_tokens(hash_id)
    assert block == block_tokens(hash_id)
    assert len(block) == 512
    assert all(10 <= t < 3000 for t in block)


@given(st.integers(0, 2**40), st.integers(0, 2**40))
def test_different_hash_ids_give_different_blocks(a: int, b: int) -> None:
    if a != b:
        assert block_tokens(a) != block_tokens(b)


def test_block_tokens_are_pinned_and_respect_vocab() -> None:
    # The same ids in every process and release, so servers' caches see the same prompts.
    assert block_tokens(0)[:3] == [115, 1235, 490]
    assert block_tokens(0, 512, (10, 3000)) == block_tokens(0)
    small = block_tokens(7, 64, (100, 104))
    assert len(small) == 64 and set(small) <= {100, 101, 102, 103}
    with pytest.raises(ValueError):
        block_tokens(-1)
    with pytest.raises(ValueError):
        block_tokens(1, 512, (5, 5))


def test_prompts_are_blocks_cut_to_input_length(trace: Path) -> None:
    reqs = load_mooncake_trace(trace, model="m")
    prompts = [r.body["prompt"] for r in reqs]
    assert [len(p) for p in prompts] == [n for _, n, _, _ in ROWS]
    assert prompts[0] == block_tokens(0) + block_tokens(1) + block_tokens(2)[:176]
    assert prompts[1][:1024] == prompts[0][:1024]
    assert prompts[1][1024:] == block_tokens(3)[:276]
    assert prompts[2][512:1024] == block_tokens(9)
    assert prompts[2][1024:] == block_tokens(1)[:376]
    assert prompts[3] == prompts[0][:1100]
    assert prompts[5] == block_tokens(5)[:300]
    for r, (_, _, out, _) in zip(reqs, ROWS, strict=True):
        assert r.path == "/v1/completions"
        assert r.body["max_tokens"] == out
        assert r.body["ignore_eos"] is True and r.body["temperature"] == 0
        assert r.body["model"] == "m"
        CompletionRequest.model_validate(r.body)  # ember's server accepts the body
    assert [r.request_id for r in reqs] == [f"mooncake-{i}" for i in range(len(ROWS))]


def test_ideal_cached_tokens_and_hit_ratio_by_hand(trace: Path) -> None:
    reqs = load_mooncake_trace(trace, model="m")
    assert [r.ideal_cached_tokens for r in reqs] == IDEAL
    assert ideal_hit_ratio(reqs) == sum(IDEAL) / (1200 + 1300 + 1400 + 1100 + 1536 + 300)
    assert ideal_hit_ratio(reqs) == 3836 / 6836
    assert ideal_hit_ratio([]) == 0.0


def test_time_scale_and_max_requests(trace: Path) -> None:
    times = [t / 1000 for t, _, _, _ in ROWS]
    assert [r.send_at for r in load_mooncake_trace(trace, model="m")] == times
    half = load_mooncake_trace(trace, model="m", time_scale=0.5)
    assert [r.send_at for r in half] == pytest.approx([t * 0.5 for t in times])
    burst = load_mooncake_trace(trace, model="m", time_scale=0)
    assert [r.send_at for r in burst] == [0.0] * len(ROWS)
    first = load_mooncake_trace(trace, model="m", max_requests=3)
    assert [r.ideal_cached_tokens for r in first] == IDEAL[:3]
    assert [r.body["prompt"] for r in first] == [
        r.body["prompt"] for r in load_mooncake_trace(trace, model="m")[:3]
    ]
    assert load_mooncake_trace(trace, model="m", max_requests=0) == []
    with pytest.raises(ValueError):
        load_mooncake_trace(trace, model="m", time_scale=-1)


def test_bad_rows_are_rejected(tmp_path: Path) -> None:
    too_long = write_trace(tmp_path / "long.jsonl", [(0, 1025, 1, [0, 1])])
    with pytest.raises(ValueError, match="does not fit"):
        read_mooncake_rows(too_long)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"timestamp": 0, "input_length": 3}\n')
    with pytest.raises(ValueError, match="broken.jsonl:1"):
        read_mooncake_rows(broken)


def _reference_ideal(rows: list[MooncakeRow], block_size: int) -> list[int]:
    """Token by token: the longest common prefix with any earlier prompt, a token being
    (hash id, position in block)."""

    def tokens(row: MooncakeRow) -> list[tuple[int, int]]:
        seq = [(h, j) for h in row.hash_ids for j in range(block_size)]
        return seq[: row.input_length]

    def common(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    seqs = [tokens(r) for r in rows]
    return [max((common(s, e) for e in seqs[:i]), default=0) for i, s in enumerate(seqs)]


@st.composite
def traces(draw: st.DrawFn, block_size: int = 4) -> list[MooncakeRow]:
    rows = []
    for t in range(draw(st.integers(1, 8))):
        hash_ids = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
        full = len(hash_ids) * block_size
        length = draw(st.integers(full - block_size + 1, full))
        rows.append(MooncakeRow(float(t), length, 1, tuple(hash_ids)))
    return rows


@given(traces())
def test_ideal_cache_is_longest_prefix_shared_with_an_earlier_prompt(
    rows: list[MooncakeRow],
) -> None:
    assert ideal_cached_tokens(rows, block_size=4) == _reference_ideal(rows, 4)


def test_real_trace_loads() -> None:
    assert REAL_TRACE.is_file(), f"{REAL_TRACE} is missing"
    reqs = load_mooncake_trace(REAL_TRACE, model="m", max_requests=500)
    assert len(reqs) == 500
    assert all(0 <= r.ideal_cached_tokens <= len(r.body["prompt"]) for r in reqs)
    rows = read_mooncake_rows(REAL_TRACE)
    cached = ideal_cached_tokens(rows)
    assert [r.ideal_cached_tokens for r in reqs] == cached[:500]
    ratio = sum(cached) / sum(r.input_length for r in rows)
    print(f"real Mooncake conversation trace: {len(rows)} requests, ideal hit ratio {ratio:.4f}")
    assert 0 < ratio < 1
    assert 0 < ideal_hit_ratio(reqs) < 1


def test_real_trace_cut_to_a_servers_context() -> None:
    """`ember bench` against a 2,048-token server: every request fits, and the ideal ratio is the
    cut trace's (no more cached tokens than a cut prompt has)."""
    assert REAL_TRACE.is_file(), f"{REAL_TRACE} is missing"
    full = load_mooncake_trace(REAL_TRACE, model="m", max_requests=50)
    reqs = load_mooncake_trace(REAL_TRACE, model="m", max_requests=50, max_model_len=2048)
    assert any(len(r.body["prompt"]) + r.body["max_tokens"] > 2048 for r in full)
    assert all(len(r.body["prompt"]) + r.body["max_tokens"] <= 2048 for r in reqs)
    assert all(0 <= r.ideal_cached_tokens <= len(r.body["prompt"]) for r in reqs)
    for cut, whole in zip(reqs, full, strict=True):  # a cut prompt is the start of the whole one
        assert whole.body["prompt"][: len(cut.body["prompt"])] == cut.body["prompt"]
