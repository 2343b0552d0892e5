"""What the router knows of a request's prompt before sending it: its length in tokens and its
chained block hashes, computed exactly as the engines compute them (same tokenizer, chat template
and hash chain), so the prefix index can say how much of it each endpoint has cached."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.kv.block_hash import BlockHash, hash_blocks
from ember.tokenizer.tokenizer import Tokenizer

CHARS_PER_TOKEN = 4
"""Without a tokenizer, prompt length is estimated from its characters."""


@dataclass(slots=True)
class PromptInfo:
    num_tokens: int
    token_ids: list[int] | None
    """None when the router has no tokenizer: then there are no hashes and no prefix credit."""

    def hashes(self, root: bytes, block_size: int) -> list[BlockHash]:
        if self.token_ids is None or not root:
            return []
        return hash_blocks(root, self.token_ids, block_size)


class PromptReader:
    def __init__(self, model_dir: str | None) -> None:
        self.tokenizer = Tokenizer.from_dir(Path(model_dir)) if model_dir else None

    def read(self, body: dict[str, Any], chat: bool) -> PromptInfo:
        """Tokenize like `ember serve` does; fall back to a length estimate on anything odd (the
        engine, not the router, is where bad input gets its 400)."""
        try:
            if chat:
                return self._chat(body)
            return self._completion(body)
        except Exception:
            text = str(body.get("messages") or body.get("prompt") or "")
            return PromptInfo(len(text) // CHARS_PER_TOKEN, None)

    def _chat(self, body: dict[str, Any]) -> PromptInfo:
        messages = body.get("messages") or []
        if self.tokenizer is None:
            return PromptInfo(len(str(messages)) // CHARS_PER_TOKEN, None)
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=body.get("tools"),
            add_generation_prompt=body.get("add_generation_prompt", True),
            **(body.get("chat_template_kwargs") or {}),
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return PromptInfo(len(ids), ids)

    def _completion(self, body: dict[str, Any]) -> PromptInfo:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return PromptInfo(len(prompt), list(prompt))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return PromptInfo(len(prompt) // CHARS_PER_TOKEN, None)
            ids = self.tokenizer.encode(prompt)
            return PromptInfo(len(ids), ids)
        return PromptInfo(len(str(prompt)) // CHARS_PER_TOKEN, None)
