"""Token-id prompts the router cannot hash (negative, or past uint32) get no prefix credit and
reach the engine, which answers 400; hashing one raised OverflowError, a 500 (the fuzzer found
`[-588060]`)."""

from __future__ import annotations

import pytest

from ember.router.prompt import PromptReader


@pytest.mark.parametrize("bad", [-588060, -1, 1 << 32])
def test_unhashable_ids_get_no_hashes(bad: int) -> None:
    info = PromptReader(None).read({"prompt": [5, bad, 7]}, chat=False)
    assert info.num_tokens == 3 and info.token_ids is None
    assert info.hashes(b"root", 16) == []


def test_valid_ids_are_hashed() -> None:
    info = PromptReader(None).read({"prompt": list(range(40))}, chat=False)
    assert info.token_ids == list(range(40)) and len(info.hashes(b"root", 16)) == 2
