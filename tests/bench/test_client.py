"""The bench client against a fake OpenAI-compatible server that streams with known timings and
known cached-token counts: the reported TTFT, TPOT, ITL percentiles and hit ratio are the known
ones. Both run on an event loop with a virtual clock (tests/bench/virtual_time.py), so the known
sleeps are exact and the check does not depend on how loaded the machine is."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
from aiohttp import web

from ember.bench.metrics import summarize
from ember.bench.records import PlannedRequest
from ember.bench.runner import RunLimits, run_open_loop
from tests.bench import virtual_time
from tests.servers import free_port

TTFT_MS = [100, 120, 140, 160, 180, 200, 220, 240]
GAPS_MS = [30, 50, 70]  # inter-chunk gaps, cycled
CHUNKS = 7
PROMPT, CACHED = 1000, 250
TOL_MS = 1e-3  # float rounding only: the clock is virtual


def fake_app(seen: list[dict]) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"headers": dict(request.headers), "body": body})
        i = int(body["messages"][0]["content"])
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(TTFT_MS[i] / 1e3)
        for k in range(CHUNKS):
            if k:
                await asyncio.sleep(GAPS_MS[(k - 1) % len(GAPS_MS)] / 1e3)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{k} "}}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {
            "prompt_tokens": PROMPT,
            "completion_tokens": CHUNKS,
            "prompt_tokens_details": {"cached_tokens": CACHED * (i % 2)},
        }
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
        error = {"error": {"message": "engine died", "type": "server_error", "code": 502}}
        await resp.write(b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")
        return resp

    async def hang(request: web.Request) -> web.StreamResponse:
        """A request stuck in a queue: headers, then nothing for longer than any cut-off."""
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(1e5)
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/broken", broken)
    app.router.add_post("/v1/hang", hang)
    return app


async def bench(  # noqa: ANN201
    planned: list[PlannedRequest], seen: list[dict], limits: RunLimits | None = None
):
    runner = web.AppRunner(fake_app(seen))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        limits = limits or RunLimits(progress=False, api_key="k")
        return await run_open_loop(f"http://127.0.0.1:{port}", planned, limits)
    finally:
        await runner.cleanup()


def planned(i: int, path: str = "/v1/chat/completions", at: float = 0.0) -> PlannedRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": str(i)}]}
    return PlannedRequest(f"r{i}", path, body, send_at=at, session=f"ses_{i}")


def test_known_timings_and_cache_hits_are_reported() -> None:
    seen: list[dict] = []
    records, duration = virtual_time.run(bench([planned(i) for i in range(len(TTFT_MS))], seen))
    s = summarize(records, duration)
    assert s["completed"] == len(TTFT_MS) and s["errors"] == 0
    want_ttft = np.array(TTFT_MS, dtype=float)
    gaps = [GAPS_MS[(k - 1) % 3] for k in range(1, CHUNKS)]
    want_itl = np.array(gaps * len(TTFT_MS), dtype=float)
    want_tpot = sum(gaps) / (CHUNKS - 1)
    for q in (50, 90, 99):
        assert s["ttft_ms"][f"p{q}"] == pytest.approx(np.percentile(want_ttft, q), abs=TOL_MS)
        assert s["itl_ms"][f"p{q}"] == pytest.approx(np.percentile(want_itl, q), abs=TOL_MS)
        assert s["tpot_ms"][f"p{q}"] == pytest.approx(want_tpot, abs=TOL_MS)
    # Hit ratio: half the requests report 250 of 1000 prompt tokens cached.
    assert s["cache_hit_ratio"] == pytest.approx(CACHED / PROMPT / 2)
    # The client streamed with usage, sent the session header and the API key.
    for req in seen:
        assert req["body"]["stream"] is True and req["body"]["stream_options"]["include_usage"]
        assert req["headers"]["x-session-affinity"].startswith("ses_")
        assert req["headers"]["Authorization"] == "Bearer k"


def test_open_loop_sends_at_the_planned_times_and_counts_errors() -> None:
    seen: list[dict] = []
    reqs = [planned(0, at=0.0), planned(1, at=0.3), planned(2, "/v1/broken", at=0.1)]
    records, _ = virtual_time.run(bench(reqs, seen))
    by_id = {r.request_id: r for r in records}
    assert by_id["r1"].start == pytest.approx(0.3, abs=1e-6)
    assert by_id["r0"].start == pytest.approx(0.0, abs=1e-6)
    assert by_id["r2"].error == "engine died" and not by_id["r2"].ok
    s = summarize(records, 1.0)
    assert s["errors"] == 1 and s["completed"] == 2


def traced(i: int, path: str, ideal: int) -> PlannedRequest:
    """A trace-replay request: a 1000-token token-id prompt and its ideal cached tokens."""
    body = {"model": "m", "prompt": [7] * PROMPT, "max_tokens": 4}
    return PlannedRequest(f"t{i}", path, body, send_at=0.0, ideal_cached_tokens=ideal)


@pytest.mark.parametrize(
    ("request_timeout_s", "grace_s", "says"),
    [
        (5.0, 50.0, "timeout: no end within 5 s (ember bench --timeout)"),
        # The run's own cut-off: the record used to vanish (or read ServerDisconnectedError).
        (1000.0, 5.0, "timeout: still running 5 s after sending ended (ember bench's cut-off)"),
    ],
)
def test_the_bench_cut_off_is_a_timeout_and_counts_against_the_ideal(
    request_timeout_s: float, grace_s: float, says: str
) -> None:
    """The ideal hit ratio is taken over every request sent, not only the completed ones: a slice
    whose ideal was 4.17% would print "cache hit 0.0% (ideal 0.0%)", as the completed requests
    had nothing to reuse."""
    from ember.bench.report import markdown_table

    reqs = [traced(0, "/v1/hang", 0), traced(1, "/v1/hang", 500), traced(2, "/v1/hang", 1000)]
    limits = RunLimits(progress=False, grace_s=grace_s, request_timeout_s=request_timeout_s)
    records, duration = virtual_time.run(bench(reqs, [], limits))
    assert sorted(r.request_id for r in records) == ["t0", "t1", "t2"]
    assert {r.error for r in records} == {says}
    s = summarize(records, duration)
    assert s["errors"] == 3 and (s["trace_requests"], s["trace_failed"]) == (3, 3)
    assert s["ideal_cache_hit_ratio"] == pytest.approx(1500 / 3000)
    assert s["sent_cache_hit_ratio"] == 0.0
    assert "- cache hit over all 3 requests sent: 0.0% (ideal 50.0%); 3 failed" in (
        markdown_table(s)
    )


def test_ideal_and_measured_hits_cover_the_same_requests() -> None:
    # t0 completes (250 of 1000 cached, ideal 0); t1 fails (ideal 600): over all sent, measured
    # 250 / 2000 against ideal 600 / 2000; over the completed one, 25% against 0%.
    reqs = [traced(0, "/v1/chat/completions", 0), traced(1, "/v1/broken", 600)]
    reqs[0].body = {"model": "m", "messages": [{"role": "user", "content": "1"}]}
    records, duration = virtual_time.run(bench(reqs, []))
    s = summarize(records, duration)
    assert (s["trace_requests"], s["trace_failed"]) == (2, 1)
    # t0's prompt is text: its denominator is the server's count (1000), t1's the 1000 sent.
    assert s["sent_cache_hit_ratio"] == pytest.approx(250 / 2000)
    assert s["ideal_cache_hit_ratio"] == pytest.approx(600 / 2000)
    assert s["cache_hit_ratio"] == pytest.approx(250 / 1000)
    assert s["completed_ideal_cache_hit_ratio"] == 0.0
