"""The agentic workload: sessions that grow by one answer and one tool result a turn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.bench.records import PlannedRequest
from ember.bench.workloads import AgenticWorkload
from ember.server.protocol import ChatCompletionRequest


def small(**kw: object) -> AgenticWorkload:
    args: dict = {"system_words": 300, "tool_result_words": (20, 40), "user_words": (5, 10)}
    args.update(kw)
    return AgenticWorkload(3, 4, model="m", **args)


def drive(w: AgenticWorkload, session_idx: int) -> list[PlannedRequest]:
    req: PlannedRequest | None = w.first(session_idx)
    turns = []
    while req is not None:
        turns.append(req)
        req = w.next(req, f"answer {session_idx}/{req.turn}")
    return turns


def test_sessions_have_ids_and_the_number_of_turns() -> None:
    w = small()
    for i in range(3):
        turns = drive(w, i)
        assert len(turns) == 4
        assert [r.session for r in turns] == [f"ses_{i}"] * 4
        assert [r.turn for r in turns] == [0, 1, 2, 3]
        assert [r.request_id for r in turns] == [f"ses_{i}-turn-{t}" for t in range(4)]
        assert all(r.send_at is None and r.path == "/v1/chat/completions" for r in turns)
    assert (
        AgenticWorkload(1, 1, model="m").next(AgenticWorkload(1, 1, model="m").first(0), "x")
        is None
    )


def test_each_turn_appends_the_answer_and_a_tool_result() -> None:
    w = small()
    turns = drive(w, 1)
    first = turns[0].body["messages"]
    assert [m["role"] for m in first] == ["system", "user"]
    assert first[1]["content"].startswith("Task: ")
    assert 5 <= len(first[1]["content"].split()) - 1 <= 10
    for prev, cur in zip(turns, turns[1:], strict=False):
        before, after = prev.body["messages"], cur.body["messages"]
        assert len(after) == len(before) + 2
        assert after[: len(before)] == before
        assert after[-2] == {"role": "assistant", "content": f"answer 1/{prev.turn}"}
        assert after[-1]["role"] == "user"
        assert after[-1]["content"].startswith("Tool result: ")
        assert 20 <= len(after[-1]["content"].split()) - 2 <= 40


def test_body_is_a_chat_request_with_tools_ember_accepts() -> None:
    w = small(max_tokens=64)
    for r in drive(w, 0):
        body = r.body
        assert body["model"] == "m" and body["max_tokens"] == 64
        assert body["temperature"] == 0 and body["ignore_eos"] is True
        names = {t["function"]["name"] for t in body["tools"]}
        assert {"read_file", "write_file", "run_tests", "search"} <= names
        for tool in body["tools"]:
            assert tool["type"] == "function"
            assert tool["function"]["description"]
            assert tool["function"]["parameters"]["type"] == "object"
        ChatCompletionRequest.model_validate(body)


def test_system_prompt_is_long_and_identical_across_sessions_and_seeds() -> None:
    w = AgenticWorkload(4, 2, model="m")
    systems = {w.first(i).body["messages"][0]["content"] for i in range(4)}
    systems.add(AgenticWorkload(1, 1, model="m", seed=9).first(0).body["messages"][0]["content"])
    assert systems == {w.system_prompt}
    assert 2900 <= len(w.system_prompt.split()) <= 3100
    assert w.first(0).body["tools"] == w.first(3).body["tools"]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31))
def test_deterministic_per_seed(seed: int) -> None:
    a, b = small(seed=seed), small(seed=seed)
    assert [r.body for r in drive(a, 2)] == [r.body for r in drive(b, 2)]
    other = small(seed=seed + 1)
    assert [r.body for r in drive(a, 2)] != [r.body for r in drive(other, 2)]


def test_a_turn_does_not_depend_on_the_order_sessions_run() -> None:
    w = small()
    late = drive(w, 2)
    w2 = small()
    drive(w2, 0)
    drive(w2, 1)
    assert [r.body for r in drive(w2, 2)] == [r.body for r in late]


def test_session_starts_and_affinity() -> None:
    assert [small().session_start(i) for i in range(3)] == [0.0, 0.0, 0.0]
    w = AgenticWorkload(200, 1, model="m", rate=10.0, system_words=10)
    starts = [w.session_start(i) for i in range(200)]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert starts[-1] / 199 == pytest.approx(0.1, rel=0.3)
    assert small().affinity is True
    assert small(affinity=False).affinity is False


def test_bad_calls() -> None:
    w = small()
    with pytest.raises(IndexError):
        w.first(3)
    with pytest.raises(IndexError):
        w.session_start(-1)
    foreign = PlannedRequest("x", "/v1/chat/completions", {"messages": []})
    with pytest.raises(ValueError):
        w.next(foreign, "answer")
    with pytest.raises(ValueError):
        AgenticWorkload(1, 0, model="m")
