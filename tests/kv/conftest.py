"""Fixtures the tier tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ember.kv.tiers.manager import TierManager


@pytest.fixture
def managers() -> Iterator[list[TierManager]]:
    """Tier managers a test makes; closed (without waiting for their threads) after it."""
    made: list[TierManager] = []
    yield made
    for m in made:
        m.close(wait=False)
