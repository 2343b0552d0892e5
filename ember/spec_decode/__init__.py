"""Speculative decoding: proposers that guess the next tokens (n-gram prompt lookup, suffix trees,
an EAGLE-3 draft head) and the exact rejection sampling that keeps the target's distribution."""
