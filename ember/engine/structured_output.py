"""Structured outputs: grammars (JSON schema, regex, Lark) compiled by llguidance into per-request
matchers that mask the logits each step, so the output always parses.

llguidance rather than our own: it computes a vocabulary mask in microseconds from a tokenizer's
byte-level vocabulary, supports JSON schema, regex and Lark, and has no dependencies.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from llguidance import LLMatcher, LLTokenizer

from ember.models.config import ModelConfig
from ember.sampling_params import StructuredOutputsParams
from ember.tokenizer.tokenizer import tokenizer_json

if TYPE_CHECKING:
    import torch  # (the API process validates grammars here and imports no torch)


def grammar_of(so: StructuredOutputsParams) -> str:
    if so.json is not None:
        # Compact JSON unless the schema's x-guidance says otherwise: a model left free to emit
        # whitespace can spend its whole budget on it.
        return LLMatcher.grammar_from_json_schema(so.json, defaults={"whitespace_flexible": False})
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    return LLMatcher.grammar_from_lark(so.lark or "")


def validate(so: StructuredOutputsParams, tokenizer: LLTokenizer | None = None) -> None:
    """Raise ValueError naming the problem if the grammar does not compile. With a tokenizer the
    check is complete (regexes are only compiled then)."""
    try:
        grammar = grammar_of(so)
    except ValueError as e:
        raise ValueError(f"invalid structured output spec: {e}") from None
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"invalid structured output spec: {error}")


class GrammarCompiler:
    """Makes matchers for one engine; the tokenizer side is built once, on first use."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: LLTokenizer | None = None

    @classmethod
    def for_model(cls, model_dir: str, config: ModelConfig) -> GrammarCompiler:
        eos = config.raw.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(tokenizer_json(model_dir), config.vocab_size, eos_ids)

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._tokenizer

    def validate(self, so: StructuredOutputsParams) -> None:
        validate(so, self.tokenizer)

    def matcher(self, so: StructuredOutputsParams) -> LLMatcher:
        m = LLMatcher(self.tokenizer, grammar_of(so), log_level=0)
        if m.is_error():
            raise ValueError(f"invalid structured output spec: {m.get_error()}")
        return m


@functools.cache
def _bits() -> torch.Tensor:
    import torch

    return torch.arange(32, dtype=torch.int32)


def apply_grammar_masks(
    logits: torch.Tensor,
    matchers: list[LLMatcher | None],
    drafts: list[list[int]] | None = None,
) -> None:
    """Set to -inf, in place, every token that request i's matcher does not allow next.

    With drafts, request i has len(drafts[i]) + 1 consecutive rows: row j is masked as the
    grammar stands after drafts[i][:j]. The matcher steps through the drafts the grammar allows
    and is rolled back after; rows past a draft the grammar refuses stay unmasked (that draft's
    own row forbids it, so it is rejected and they are never used)."""
    vocab = logits.shape[-1]
    row = 0
    for i, m in enumerate(matchers):
        d = drafts[i] if drafts is not None else []
        if m is not None and not m.is_stopped():
            valid = m.validate_tokens(d) if d else 0
            consumed = 0
            for j in range(valid + 1):
                if m.is_stopped():  # the grammar ended at the draft before: nothing follows
                    break
                _mask_row(logits[row + j], m, vocab)
                if j < valid:
                    m.consume_token(d[j])
                    consumed += 1
            if consumed:
                m.rollback(consumed)
        row += len(d) + 1


def _mask_row(row: torch.Tensor, m: LLMatcher, vocab: int) -> None:
    import torch

    words = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> _bits()) & 1).reshape(-1)[:vocab].bool()
    row.masked_fill_(~allowed.to(row.device), float("-inf"))
