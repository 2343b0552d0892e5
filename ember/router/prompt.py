"""What the router knows of a request's prompt before sending it: its length in tokens and its
chained block hashes, computed exactly as the engines compute them (same tokenizer, chat template,
hash chain and cache salt), so the prefix index can say how much of it each endpoint has cached."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.kv.block_hash import BlockHash, hash_blocks
from ember.tokenizer.tokenizer import Tokenizer

TOKEN_ID_LIMIT = 1 << 32
"""Block hashes pack token ids as uint32."""
CHARS_PER_TOKEN = 4
"""Without a tokenizer, prompt length is estimated from its characters."""
BIG_TEXT_CHARS = 64 << 10
"""Longer texts are encoded through `encode_batch`, which lets go of the GIL while it runs (a plain
`encode` holds it: a 1 MB prompt froze the event loop for a second even from a thread)."""


@dataclass(slots=True)
class PromptInfo:
    num_tokens: int
    token_ids: list[int] | None
    """None when the router has no tokenizer (or the request holds a batch of prompts): then there
    are no hashes and no prefix credit."""
    salt: str | None = None
    """The request's cache salt (`trust.cache_namespace`): it goes into block 0's hash, as on the
    engine, so a tenant's prompt matches only blocks cached under its own namespace."""
    batch: bool = False
    """The request holds several prompts (it is never split into prefill and decode legs)."""

    def hashes(self, root: bytes, block_size: int) -> list[BlockHash]:
        if self.token_ids is None or not root:
            return []
        extra = (self.salt,) if self.salt is not None else None
        return hash_blocks(root, self.token_ids, block_size, first_extra_keys=extra)


class PromptReader:
    def __init__(self, model_dir: str | None) -> None:
        self.tokenizer = Tokenizer.from_dir(Path(model_dir)) if model_dir else None

    def read(self, body: dict[str, Any], chat: bool, salt: str | None = None) -> PromptInfo:
        """Tokenize like `ember serve` does; fall back to a length estimate on anything odd (the
        engine, not the router, is where bad input gets its 400)."""
        try:
            info = self._chat(body) if chat else self._completion(body)
        except Exception:
            text = str(body.get("messages") or body.get("prompt") or "")
            info = PromptInfo(len(text) // CHARS_PER_TOKEN, None)
        info.salt = salt
        return info

    def _chat(self, body: dict[str, Any]) -> PromptInfo:
        messages = body.get("messages") or []
        if self.tokenizer is None:
            return PromptInfo(len(str(messages)) // CHARS_PER_TOKEN, None)
        tools = body.get("tools")
        text = self.tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            tools=[template_tool(t) for t in tools] if tools else None,
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        ids = self._encode(text, add_special_tokens=False)
        return PromptInfo(len(ids), ids)

    def _completion(self, body: dict[str, Any]) -> PromptInfo:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            # Ids outside what a block hash holds get no hashes (the engine answers them with a
            # 400); hashing a negative id raised OverflowError, a 500 (found by the fuzzer).
            valid = all(0 <= t < TOKEN_ID_LIMIT for t in prompt)
            return PromptInfo(len(prompt), list(prompt) if valid else None)
        if isinstance(prompt, str):
            return self._text(prompt)
        if isinstance(prompt, list) and prompt:
            # A batch (strings or token lists): its size counts for load, never for prefix credit.
            sizes = [
                self._text(p).num_tokens
                if isinstance(p, str)
                else len(p)
                if isinstance(p, list)
                else 1
                for p in prompt
            ]
            return PromptInfo(sum(sizes), None, batch=True)
        return PromptInfo(len(str(prompt)) // CHARS_PER_TOKEN, None)

    def _text(self, prompt: str) -> PromptInfo:
        if self.tokenizer is None:
            return PromptInfo(len(prompt) // CHARS_PER_TOKEN, None)
        ids = self._encode(prompt, add_special_tokens=True)
        return PromptInfo(len(ids), ids)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise RuntimeError("no tokenizer")
        if len(text) < BIG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        batch = self.tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return batch[0].ids


def prompt_chars(body: dict[str, Any], chat: bool) -> int:
    """Characters of text a request puts into its prompt, counted as `ember serve` counts them
    before it tokenizes (message text and reasoning; a completion's prompt strings; a token id
    counts one): cheap, so a prompt that cannot fit is refused before it is tokenized."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(_message_chars(m) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return max((len(p) if isinstance(p, str | list) else 1 for p in prompt), default=0)
    return 0


def _message_chars(m: dict[str, Any]) -> int:
    content = m.get("content")
    if isinstance(content, list):
        n = sum(
            len(p["text"])
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    else:
        n = len(content) if isinstance(content, str) else 0
    reasoning = m.get("reasoning_content")
    return n + (len(reasoning) if isinstance(reasoning, str) else 0)


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as `ember serve` hands it to the chat template (`ChatMessage.for_template`): text
    parts joined, "developer" as "system", unknown fields and nulls dropped. A client's raw message
    (OpenCode's content parts, a tool call's `index`) renders other tokens, and the prefix index
    then missed every block after the first such message."""
    role = m["role"]
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    out["content"] = "".join(p["text"] for p in content) if isinstance(content, list) else content
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            out[key] = m[key]
    if m.get("tool_calls"):
        out["tool_calls"] = [_tool_call(tc) for tc in m["tool_calls"]]
    return out


def template_tool(t: dict[str, Any]) -> dict[str, Any]:
    """A tool as the engine's template sees it (`Tool.model_dump(exclude_none=True)`)."""
    f = t["function"]
    fn = {k: f[k] for k in ("name", "description", "parameters", "strict") if f.get(k) is not None}
    return {"type": t.get("type", "function"), "function": fn}


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    f = tc["function"]
    out: dict[str, Any] = {"id": tc["id"]} if tc.get("id") is not None else {}
    out["type"] = tc.get("type", "function")
    out["function"] = {"name": f["name"], "arguments": f.get("arguments", "{}")}
    return out
