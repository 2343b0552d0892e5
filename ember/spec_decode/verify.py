"""Verification of draft tokens by exact rejection sampling.

Every proposer here drafts deterministically (n-gram and suffix lookups, EAGLE-3's greedy chain):
given the context, the draft distribution q is a point mass on the draft token d. Rejection
sampling (Leviathan et al. 2023; Chen et al. 2023) accepts d with probability min(1, p(d) / q(d))
= p(d) and, on rejection, samples from the residual max(0, p - q) normalised, which is p with d
removed. Drawing x ~ p and accepting d exactly when x == d does both at once: P(accept) = p(d),
and a rejected x is distributed as p conditioned on x != d. So each verification row samples the
target's own processed distribution (temperature, top-k, top-p, min-p, penalties, grammar, with
the earlier drafts counted as output), the drafts are accepted while they equal the samples, and
the first differing sample (or, when every draft is accepted, the sample after the last) is the
next token: the output is distributed exactly as without speculation, and greedy output is the
same token for token.
"""

from __future__ import annotations

from collections.abc import Sequence


def verify_rows(ends: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[int]:
    """Flat token positions whose logits sample: for a request whose scheduled tokens end (one
    past the last) at `ends[j]` with k drafts, its last k + 1 positions (the last known token's,
    then each draft's)."""
    rows: list[int] = []
    for end, d in zip(ends, drafts, strict=True):
        rows.extend(range(end - len(d) - 1, end))
    return rows


def last_rows(drafts: Sequence[Sequence[int]]) -> list[int]:
    """Index of each request's last sampling row among all rows (k + 1 rows per request)."""
    rows, row = [], -1
    for d in drafts:
        row += len(d) + 1
        rows.append(row)
    return rows


def num_accepted(samples: Sequence[int], drafts: Sequence[int]) -> int:
    """Leading drafts equal to the sample of the row before them: samples[i] was drawn at the
    position of drafts[i] (after drafts[:i]), so drafts[i] stands iff samples[i] == drafts[i]."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} samples, got {len(samples)}")
    n = 0
    while n < len(drafts) and samples[n] == drafts[n]:
        n += 1
    return n
