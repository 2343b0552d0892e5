"""The OpenAI answers the router writes itself: usage.cached_tokens rewritten to the prefill side's
count, a whole prefill answer replayed as the stream chunks an engine would have sent, SSE framing."""

from __future__ import annotations

import time
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def cached_tokens(obj: dict[str, Any]) -> int | None:
    usage = obj.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def set_cached(obj: dict[str, Any], cached: int) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        usage["prompt_tokens_details"] = {
            **(usage.get("prompt_tokens_details") or {}),
            "cached_tokens": cached,
        }


def as_chunks(full: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A whole answer as the stream chunks an engine would have sent."""
    base = {"id": full.get("id"), "created": full.get("created", int(time.time()))}
    base["model"] = full.get("model")
    chunks: list[dict[str, Any]] = []
    chat = full.get("object") == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    for c in full.get("choices", []):
        if chat:
            msg = c.get("message") or {}
            delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(msg["tool_calls"])]
            chunks.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {
                            "index": c.get("index", 0),
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
            chunks.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {
                            "index": c.get("index", 0),
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": c.get("finish_reason"),
                        }
                    ],
                }
            )
        else:
            chunks.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {
                            "index": c.get("index", 0),
                            "text": c.get("text", ""),
                            "logprobs": None,
                            "finish_reason": c.get("finish_reason"),
                        }
                    ],
                }
            )
    if include_usage:
        chunks.append({**base, "object": obj, "choices": [], "usage": full.get("usage")})
    return chunks
