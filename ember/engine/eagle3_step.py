"""EAGLE-3 after each step of the target: the head's KV grows by the positions the step computed
and kept, and the requests that speculate get their next K drafts (called by the model runner once
the step's tokens are on the host). It reads the scheduler's output, so it sits in the engine, above
the draft head in ember/spec_decode/eagle3.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember.spec_decode.eagle3 import DraftRow

if TYPE_CHECKING:
    import torch

    from ember.engine.scheduler import SchedulerOutput
    from ember.spec_decode.eagle3 import Eagle3Drafter


def draft_after_step(
    drafter: Eagle3Drafter,
    k: int,
    block_size: int,
    so: SchedulerOutput,
    aux: torch.Tensor,
    flat: list[int],
    sampled: list[int | None],
    accepted: list[list[int]],
) -> list[list[int]]:
    """Every speculative request's new positions extend the draft head's KV (token t_{p+1} with
    the target's hidden state h_p: the accepted ones only), and the requests that speculate and
    sampled get K drafts chained from their last. `aux` holds the step's aux hidden states, each
    request's positions from `flat[i]`."""
    drafts: list[list[int]] = [[] for _ in so.requests]
    chain: list[tuple[int, DraftRow]] = []
    extend: list[DraftRow] = []
    for i, req in enumerate(so.requests):
        if not req.sampling_params.speculative or req.spec_stale:
            continue
        start, n = so.num_computed_tokens[i], so.num_scheduled_tokens[i]
        rejected = len(so.spec_token_ids[i]) - len(accepted[i]) if so.spec_token_ids else 0
        valid = n - rejected
        tok = sampled[i]
        new = [*accepted[i], tok] if tok is not None else []
        known = req.all_token_ids[start + 1 : start + valid]
        tokens = (known + new)[:valid]
        if len(tokens) != valid or not valid:
            continue  # tokens still in flight (async): nothing to extend with yet
        row = DraftRow(so.block_ids[i], start, tokens, aux[flat[i] : flat[i] + valid])
        # The chain writes K - 1 positions past the last valid one: only into blocks the
        # scheduler gave it (lookahead), else no drafts this step.
        room = len(so.block_ids[i]) * block_size - (start + valid) + 1
        if tok is not None and req.speculates and room >= k:
            chain.append((i, row))
        else:
            extend.append(row)
    if extend:
        drafter.propose(extend, 0)
    if chain:
        for (i, _), d in zip(chain, drafter.propose([r for _, r in chain], k), strict=True):
            drafts[i] = d
    return drafts
