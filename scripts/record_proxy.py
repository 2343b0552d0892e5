"""A loopback recording proxy for real clients (OpenCode, AIPerf, `vllm bench serve`).

It forwards every request to an upstream ember (router or engine) unchanged, except that
`--cap-max-tokens N` lowers `max_tokens` so a random-weight tiny model stops soon, and appends
each request's method, path, headers (secrets replaced) and JSON body to a JSONL file, then a
line with the answer's status and usage. `tests/clients/` fixtures are cut from that file.

    python scripts/record_proxy.py --port 9100 --upstream http://127.0.0.1:8000 --out rec.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

# Headers whose values are credentials or say nothing about the client's request shape.
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def redact(headers: dict[str, str]) -> dict[str, str]:
    return {k: ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def usage(tail: bytes) -> dict | None:
    """The last `usage` object in an SSE stream's tail or a JSON body, if any."""
    for part in reversed(tail.replace(b"data: ", b"\n").split(b"\n")):
        if b'"usage"' in part:
            try:
                body = json.loads(part)
            except ValueError:
                continue
            if isinstance(body, dict):
                return body.get("usage")
    return None


def make_app(upstream: str, out: Path, cap_max_tokens: int | None) -> web.Application:
    session: dict[str, ClientSession] = {}

    async def start(_: web.Application) -> None:
        # No read timeout: a prefill of a long prompt on a CPU takes as long as it takes.
        session["s"] = ClientSession(timeout=ClientTimeout(total=None))

    async def stop(_: web.Application) -> None:
        await session["s"].close()

    async def proxy(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body: object = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
        with out.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "method": request.method,
                        "path": request.path_qs,
                        "headers": redact(dict(request.headers)),
                        "body": body,
                    }
                )
                + "\n"
            )
        if cap_max_tokens and isinstance(body, dict):
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(body.get(key), int) and body[key] > cap_max_tokens:
                    body[key] = cap_max_tokens
            raw = json.dumps(body).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with session["s"].request(
            request.method, upstream + request.path_qs, data=raw or None, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status)
            for k, v in up.headers.items():
                if k.lower() not in HOP_HEADERS | {"content-encoding"}:
                    resp.headers[k] = v
            await resp.prepare(request)
            tail = b""  # the last few KB: where a stream's usage chunk (or a whole body's) lies
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
                tail = (tail + chunk)[-16384:]
            await resp.write_eof()
        with out.open("a") as f:
            f.write(
                json.dumps({"t": time.time(), "status": up.status, "usage": usage(tail)}) + "\n"
            )
        return resp

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--out", type=Path, required=True, help="JSONL file, appended to")
    p.add_argument("--cap-max-tokens", type=int, default=None)
    args = p.parse_args()
    app = make_app(args.upstream.rstrip("/"), args.out, args.cap_max_tokens)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
