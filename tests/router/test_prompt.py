"""PromptInfo hashes a prompt as the engine does, cache salt included: a tenant's prompt matches
only blocks cached under its own namespace."""

from __future__ import annotations

from ember.kv.block_hash import hash_blocks
from ember.router.prefix_index import PrefixIndex
from ember.router.prompt import PromptInfo
from ember.trust import cache_namespace

ROOT = b"r" * 32
IDS = list(range(64))


def test_salted_hashes_are_the_engines_and_tenants_do_not_match_each_other() -> None:
    a, b = cache_namespace("tenant-a", None), cache_namespace("tenant-b", None)
    assert PromptInfo(64, IDS, a).hashes(ROOT, 16) == hash_blocks(
        ROOT, IDS, 16, first_extra_keys=(a,)
    )
    assert PromptInfo(64, IDS).hashes(ROOT, 16) == hash_blocks(ROOT, IDS, 16)
    index = PrefixIndex()
    index.apply("http://e", PromptInfo(64, IDS, a).hashes(ROOT, 16), [])
    assert index.match(PromptInfo(64, IDS, a).hashes(ROOT, 16)) == {"http://e": 4}
    assert index.match(PromptInfo(64, IDS, b).hashes(ROOT, 16)) == {}
    assert index.match(PromptInfo(64, IDS).hashes(ROOT, 16)) == {}
