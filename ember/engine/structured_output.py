"""Structured outputs: grammars (JSON schema, regex, Lark) compiled by llguidance into per-request
matchers that mask the logits each step, so the output always parses.

llguidance rather than our own: it computes a vocabulary mask in microseconds from a tokenizer's
byte-level vocabulary, supports JSON schema, regex and Lark, and has no dependencies.

Torch-free: the API process validates grammars at the edge and does not import torch; the masks
are applied in the engine core (ember/engine/grammar_masks.py).
"""

from __future__ import annotations

from llguidance import LLMatcher, LLTokenizer

from ember.models.config import ModelConfig
from ember.sampling_params import StructuredOutputsParams
from ember.tokenizer.tokenizer import tokenizer_json


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
