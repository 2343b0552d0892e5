"""The shared-memory KV transport: one CPU engine reads another's blocks through a 0600 memfd it
maps read-only, with no network port; addresses that do not name a live ember KV file map nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ember.kv.transport import TransferError, make_transport, pair_regions
from ember.kv.transport.listen_host import listening_sockets

SHAPE = (16, 2, 2, 4, 2, 8)  # [blocks, layers, K/V, block size, heads, head dim]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4  # float32

OWNER = textwrap.dedent(
    """
    import json, sys, torch
    from ember.kv.transport import make_transport
    t = make_transport("shm")
    cache = t.allocate((16, 2, 2, 4, 2, 8), torch.float32, torch.device("cpu"))
    cache.copy_(torch.arange(cache.numel(), dtype=torch.float32).view_as(cache))
    base = t.register(cache)
    print(json.dumps({"address": t.address, "base": base}), flush=True)
    sys.stdin.readline()
    """
)


@pytest.fixture(scope="module")
def owner():
    """Another process that owns a KV cache in shared memory (until its stdin closes)."""
    p = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    info = json.loads(p.stdout.readline())
    info["pid"] = p.pid
    yield info
    p.stdin.close()  # type: ignore[union-attr]
    p.wait(10)


def reader():  # noqa: ANN201
    t = make_transport("shm")
    cache = t.allocate(SHAPE, torch.float32, torch.device("cpu"))
    return t, cache, t.register(cache)


def test_blocks_cross_processes_with_no_port(owner) -> None:
    expected = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE)
    before = listening_sockets()
    t, cache, base = reader()
    srcs, dsts, lens = pair_regions(owner["base"], base, BLOCK_BYTES, [3, 4, 9], [0, 1, 7])
    t.read(owner["address"], srcs, dsts, lens)
    assert torch.equal(cache[0], expected[3]) and torch.equal(cache[1], expected[4])
    assert torch.equal(cache[7], expected[9])
    assert cache[2].eq(0).all()  # nothing else written
    assert listening_sockets() == before  # the transport opened no port
    assert listening_sockets(owner["pid"]) == set()  # nor did the owner's
    t.close()


def test_the_memory_is_private_and_peers_can_only_read(owner) -> None:
    _, fd, nonce = owner["address"].split(":")[1:4]
    path = f"/proc/{owner['pid']}/fd/{fd}"
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.readlink(path).startswith(f"/memfd:ember-kv-{nonce}")
    t, _, base = reader()
    with pytest.raises(TransferError, match="only reads"):
        t.write(owner["address"], [base], [owner["base"]], [BLOCK_BYTES])
    t.close()


@pytest.mark.parametrize(
    "forge",
    [
        lambda a: a.replace(a.split(":")[3], "0" * 16),  # another file's nonce
        lambda a: a.replace(f":{a.split(':')[2]}:", ":0:", 1),  # the owner's stdin, not its KV
        lambda a: "shm:1:3:" + "ab" * 8 + ":0:64",  # another process altogether
        lambda a: "/etc/passwd",
        lambda a: "127.0.0.1:12345",  # a Mooncake address
    ],
    ids=["nonce", "fd", "pid", "path", "host"],
)
def test_an_address_that_is_not_a_live_kv_file_maps_nothing(owner, forge) -> None:
    t, cache, base = reader()
    with pytest.raises(TransferError):
        t.read(forge(owner["address"]), [owner["base"]], [base], [BLOCK_BYTES])
    assert cache.eq(0).all()
    t.close()


def test_reads_outside_either_side_are_refused(owner) -> None:
    t, cache, base = reader()
    end = owner["base"] + torch.Size(SHAPE).numel() * 4
    for remote, local, n in [
        (end - 8, base, 16),  # past the peer's memory
        (owner["base"] - 8, base, 8),  # before it
        (owner["base"], base + cache.numel() * 4 - 8, 16),  # past ours
        (owner["base"], 4096, 8),  # somewhere in our process that is not the cache
    ]:
        with pytest.raises(TransferError, match="outside"):
            t.read(owner["address"], [remote], [local], [n])
    assert cache.eq(0).all()
    t.close()


def test_register_takes_only_memory_it_allocated() -> None:
    t = make_transport("shm")
    with pytest.raises(ValueError, match="only memory it allocated"):
        t.register(torch.zeros(64))
    with pytest.raises(ValueError, match="CPU"):
        t.allocate((4,), torch.float32, torch.device("meta"))
