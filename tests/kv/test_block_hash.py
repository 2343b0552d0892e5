import subprocess
import sys

from ember.kv.block_hash import hash_block_tokens, hash_blocks, root_hash


def test_chained_hashes_depend_on_prefix_and_are_full_sha256() -> None:
    root = root_hash("m")
    a = hash_blocks(root, list(range(8)), 4)
    b = hash_blocks(root, [99, 1, 2, 3, 4, 5, 6, 7], 4)
    assert len(a) == 2 and all(len(h) == 32 for h in a)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different parent
    assert hash_blocks(root, list(range(8)) + [1, 2], 4) == a  # partial block not hashed


def test_incremental_hashing_matches_whole() -> None:
    root = root_hash("m")
    toks = list(range(20))
    whole = hash_blocks(root, toks, 4)
    first = hash_blocks(root, toks[:9], 4)
    rest = hash_blocks(first[-1], toks, 4, start_block=len(first))
    assert first + rest == whole


def test_namespace_and_extra_keys_separate_chains() -> None:
    toks = [1, 2, 3, 4]
    assert hash_blocks(root_hash("a"), toks, 4) != hash_blocks(root_hash("b"), toks, 4)
    r = root_hash("a")
    assert hash_block_tokens(r, toks, ("salt",)) != hash_block_tokens(r, toks)


def test_hash_identical_across_processes() -> None:
    code = (
        "from ember.kv.block_hash import hash_blocks, root_hash;"
        "print(hash_blocks(root_hash('m'), list(range(12)), 4)[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert len(outs) == 1
    assert outs == {hash_blocks(root_hash("m"), list(range(12)), 4)[-1].hex()}
