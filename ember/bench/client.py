"""One streamed request to an OpenAI-compatible server, timed: the time to the first output chunk,
the gaps between output chunks, the end, and the usage the server reports (aiohttp: the client's
own CPU per event must stay small next to what it measures).

Times come from the event loop's clock (`now()`: time.monotonic on a normal loop), so that a test
can run the client on a loop with a virtual clock and check the arithmetic without scheduling
jitter."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from ember.bench.records import PlannedRequest, RequestRecord


def now() -> float:
    """Seconds on the running event loop's clock (monotonic)."""
    return asyncio.get_running_loop().time()


def _output_of(chunk: dict[str, Any]) -> str | None:
    """The text (or tool-call arguments) a chunk carries; None if it carries no output."""
    out = []
    for c in chunk.get("choices") or ():
        if "text" in c and c["text"]:
            out.append(c["text"])
        delta = c.get("delta") or {}
        if delta.get("content"):
            out.append(delta["content"])
        for tc in delta.get("tool_calls") or ():
            fn = tc.get("function") or {}
            out.append((fn.get("name") or "") + (fn.get("arguments") or ""))
        if delta.get("reasoning_content"):
            out.append(delta["reasoning_content"])
    return "".join(out) if out else None


async def send(
    http: aiohttp.ClientSession,
    base_url: str,
    req: PlannedRequest,
    started: float,
    *,
    api_key: str | None = None,
    affinity: bool = True,
    timeout_s: float = 600.0,
) -> RequestRecord:
    """Send `req` streamed and measure it; never raises for a failed request (the record says)."""
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    if affinity and req.session:
        headers["x-session-affinity"] = req.session
    t0 = now()
    rec = RequestRecord(
        req.request_id,
        start=t0 - started,
        session=req.session,
        turn=req.turn,
        ideal_cached_tokens=req.ideal_cached_tokens,
        sent_prompt_tokens=req.prompt_token_count,
    )
    last: float | None = None
    text: list[str] = []
    done = False
    try:
        async with http.post(
            base_url.rstrip("/") + req.path,
            data=orjson.dumps(body),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            async for raw in r.content:
                if not raw.startswith(b"data: "):
                    continue
                if raw.startswith(b"data: [DONE]"):
                    done = True
                    break
                at = now()
                chunk = orjson.loads(raw[6:])
                if "error" in chunk:
                    err = chunk["error"]
                    rec.error = str(err.get("message") if isinstance(err, dict) else err)
                    continue
                piece = _output_of(chunk)
                if piece is not None:
                    if last is None:
                        rec.ttft = at - t0
                    else:
                        rec.itl.append(at - last)
                    last = at
                    text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens") or 0
                    rec.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
                    spec = usage.get("completion_tokens_details") or {}
                    accepted = spec.get("accepted_prediction_tokens")
                    rec.accepted_prediction_tokens = accepted if isinstance(accepted, int) else None
    except TimeoutError:
        # Our own cut-off, not the server's doing: say so (aiohttp raises a bare TimeoutError).
        rec.error = f"timeout: no end within {timeout_s:g} s (ember bench --timeout)"
    except (aiohttp.ClientError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    rec.output_text = "".join(text)
    if rec.error is None and not done:
        rec.error = "the stream ended without [DONE]"
    if rec.error is None:
        rec.e2e = now() - t0
    return rec
