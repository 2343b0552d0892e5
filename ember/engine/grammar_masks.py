"""A step's logits masked by each request's grammar matcher (ember/engine/structured_output.py
compiles the matchers): every token a matcher does not allow next is set to -inf."""

from __future__ import annotations

import torch
from llguidance import LLMatcher

_BITS = torch.arange(32, dtype=torch.int32)


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
    words = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> _BITS) & 1).reshape(-1)[:vocab].bool()
    row.masked_fill_(~allowed.to(row.device), float("-inf"))
