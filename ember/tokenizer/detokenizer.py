"""Incremental detokenization: turn generated token ids into text one token at a time.

Built on `tokenizers.decoders.DecodeStream`, which holds back a token until the text it ends
with is whole, so a UTF-8 character split across tokens is never emitted as U+FFFD halves.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from ember.tokenizer.tokenizer import Tokenizer

# A few trailing prompt tokens give the stream the context some decoders need (a word's leading
# space) without decoding a long prompt on the first step.
_CONTEXT_TOKENS = 8
_INVALID_PREFIX = "Invalid prefix"


class IncrementalDetokenizer:
    """Feeds one request's output tokens through a DecodeStream and accumulates the text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = _context(tokenizer, prompt_token_ids or [], skip_special_tokens)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._output_ids: list[int] = []
        self._chunks: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text ("" while a character is incomplete)."""
        self._output_ids.append(token_id)
        try:
            chunk = self._stream.step(self._tokenizer.backend, token_id)
        except Exception as e:
            # The stream checks that new text extends what it already emitted; invalid UTF-8 from
            # a misbehaving model can break that. Start over without context rather than fail the
            # request, as vLLM does.
            if _INVALID_PREFIX not in str(e):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            chunk = self._stream.step(self._tokenizer.backend, token_id)
        if chunk:
            self._chunks.append(chunk)
        return chunk or ""

    def flush(self) -> str:
        """Emit what is still held back once the sequence has ended.

        Only a partial character can be pending; it decodes as U+FFFD, as decode() would show it.
        """
        full = self._tokenizer.decode(self._output_ids, self._skip_special_tokens)
        text = self.text
        if len(full) <= len(text) or not full.startswith(text):
            return ""
        rest = full[len(text) :]
        self._chunks.append(rest)
        return rest

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._chunks)

    @property
    def output_ids(self) -> list[int]:
        return self._output_ids


def _context(tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt's last few tokens, or none if they end inside a UTF-8 character.

    DecodeStream treats a context that ends mid-character as not yet emitted, and would print it
    as part of the first output token.
    """
    suffix = prompt_ids[-_CONTEXT_TOKENS:]
    if tokenizer.decode(suffix, skip_special_tokens).endswith("\ufffd"):
        return []
    return suffix
