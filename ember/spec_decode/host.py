"""Builds the proposer that drafts on the host from token ids, by method name."""

from __future__ import annotations

from ember.spec_decode.ngram import NgramProposer
from ember.spec_decode.proposer import HostProposer
from ember.spec_decode.suffix import SuffixProposer

HOST_METHODS = ("ngram", "suffix")


def make_host_proposer(method: str, k: int) -> HostProposer:
    """A proposer of at most `k` tokens per step with the method's default settings."""
    if method == "ngram":
        return NgramProposer(k)
    if method == "suffix":
        return SuffixProposer(k)
    raise ValueError(
        f"{method!r} is not a host proposer (one of {', '.join(HOST_METHODS)}); "
        "eagle3 drafts on the device from the target's hidden states"
    )
