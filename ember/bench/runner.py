"""Drive a workload against a server: open-loop arrivals (each request sent at its own time,
whatever the server's state, so a slow server sees the queue build as real users would make it)
or agent sessions (each session's next turn waits for its answer and a think time), bounded in
requests and in time, with a progress line."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import aiohttp

from ember.bench.client import now, send
from ember.bench.records import PlannedRequest, RequestRecord


class SessionWorkload(Protocol):
    """A workload whose next request depends on the last answer (an agent's turns)."""

    sessions: int
    affinity: bool
    think_time_s: float

    def session_start(self, session_idx: int) -> float: ...

    def first(self, session_idx: int) -> PlannedRequest: ...

    def next(self, prev: PlannedRequest, answer_text: str) -> PlannedRequest | None: ...


@dataclass(slots=True)
class RunLimits:
    max_requests: int | None = None
    duration_s: float | None = None
    """Stop sending after this long; requests in flight then are waited for (up to grace_s)."""
    grace_s: float = 600.0
    request_timeout_s: float = 600.0
    """A request with no end after this long fails as a timeout (ours, not the server's)."""
    api_key: str | None = None
    affinity: bool = True
    progress: bool = True


@dataclass(slots=True)
class Progress:
    total: int | None
    enabled: bool
    sent: int = 0
    done: int = 0
    errors: int = 0
    _last: float = field(default=0.0)

    def update(self, rec: RequestRecord | None = None, force: bool = False) -> None:
        if rec is not None:
            self.done += 1
            self.errors += rec.error is not None
        t = time.monotonic()
        if not self.enabled or (not force and t - self._last < 0.2):
            return
        self._last = t
        total = f"/{self.total}" if self.total else ""
        sys.stderr.write(f"\r  sent {self.sent}{total}  done {self.done}  errors {self.errors}   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(force=True)
            sys.stderr.write("\n")


def _connector() -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(limit=0, force_close=False)


def cut_off(req: PlannedRequest, start: float, grace_s: float) -> RequestRecord:
    """The record of a request still running when the run's grace period ended: a failure the
    report counts (it used to vanish, or surface as the closed session's ServerDisconnectedError)."""
    return RequestRecord(
        req.request_id,
        start=start,
        session=req.session,
        turn=req.turn,
        ideal_cached_tokens=req.ideal_cached_tokens,
        sent_prompt_tokens=req.prompt_token_count,
        error=f"timeout: still running {grace_s:g} s after sending ended (ember bench's cut-off)",
    )


Running = dict["asyncio.Task[None]", tuple[PlannedRequest, float]]
"""Each task that has a request in flight -> that request and when it was sent."""


async def _stop(running: Running, grace_s: float, records: list[RequestRecord]) -> None:
    """Cancel what is still running (before the session closes under it) and record each."""
    pending = [t for t in running if not t.done()]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    records.extend(cut_off(*running[t], grace_s) for t in pending)


async def run_open_loop(
    base_url: str, planned: Sequence[PlannedRequest], limits: RunLimits
) -> tuple[list[RequestRecord], float]:
    """Send each request at its `send_at`; returns the records and the run's duration."""
    todo = sorted(planned, key=lambda r: r.send_at or 0.0)
    if limits.max_requests is not None:
        todo = todo[: limits.max_requests]
    progress = Progress(len(todo), limits.progress and sys.stderr.isatty())
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=_connector()) as http:
        started = now()
        running: Running = {}

        async def one(req: PlannedRequest) -> None:
            rec = await send(
                http,
                base_url,
                req,
                started,
                api_key=limits.api_key,
                affinity=limits.affinity,
                timeout_s=limits.request_timeout_s,
            )
            records.append(rec)
            progress.update(rec)

        for req in todo:
            delay = (req.send_at or 0.0) - (now() - started)
            if limits.duration_s is not None and (req.send_at or 0.0) > limits.duration_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            running[asyncio.create_task(one(req))] = (req, now() - started)
            progress.sent += 1
            progress.update()
        if running:
            await asyncio.wait(running, timeout=limits.grace_s)
            await _stop(running, limits.grace_s, records)
        duration = now() - started
    progress.close()
    return records, duration


async def run_sessions(
    base_url: str, workload: SessionWorkload, limits: RunLimits
) -> tuple[list[RequestRecord], float]:
    """Run every session turn by turn; sessions arrive at `workload.session_start(i)`."""
    progress = Progress(limits.max_requests, limits.progress and sys.stderr.isatty())
    records: list[RequestRecord] = []
    budget = [limits.max_requests if limits.max_requests is not None else 1 << 62]
    async with aiohttp.ClientSession(connector=_connector()) as http:
        started = now()
        running: Running = {}

        def over_time() -> bool:
            return limits.duration_s is not None and now() - started > limits.duration_s

        async def session(i: int) -> None:
            me = cast("asyncio.Task[None]", asyncio.current_task())
            await asyncio.sleep(max(0.0, workload.session_start(i)))
            req: PlannedRequest | None = workload.first(i)
            while req is not None and budget[0] > 0 and not over_time():
                budget[0] -= 1
                progress.sent += 1
                running[me] = (req, now() - started)
                rec = await send(
                    http,
                    base_url,
                    req,
                    started,
                    api_key=limits.api_key,
                    affinity=limits.affinity and workload.affinity,
                    timeout_s=limits.request_timeout_s,
                )
                del running[me]
                records.append(rec)
                progress.update(rec)
                if rec.error is not None:
                    return  # an agent whose turn failed stops its session
                if workload.think_time_s:
                    await asyncio.sleep(workload.think_time_s)
                req = workload.next(req, rec.output_text)

        sessions = [asyncio.create_task(session(i)) for i in range(workload.sessions)]
        await asyncio.wait(sessions, timeout=(limits.duration_s or 1e9) + limits.grace_s)
        await _stop(running, limits.grace_s, records)
        for t in sessions:  # the rest wait between turns: cancelled, they record nothing
            t.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
        duration = now() - started
    progress.close()
    return records, duration
