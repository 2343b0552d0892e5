"""CUDA IPC between two processes on two GPUs; the address arithmetic also runs on CPU."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
import torch

from ember.kv.transport import TransferError, make_transport, pair_regions
from ember.kv.transport.cuda_ipc import Region, locate

# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: ember's KV layout.
SHAPE = (64, 2, 2, 16, 2, 8)
BLOCK_BYTES = SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * SHAPE[5] * 2  # bfloat16

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def test_locate_turns_addresses_into_offsets_and_refuses_strays() -> None:
    a, b = torch.zeros(100, dtype=torch.uint8), torch.zeros(50, dtype=torch.uint8)
    regions = [Region(1000, 100, a), Region(5000, 50, b)]
    view, offset = locate(regions, 1090, 10)
    assert view is a and offset == 90
    view, offset = locate(regions, 5000, 50)
    assert view is b and offset == 0
    for addr, nbytes in ((1095, 10), (999, 2), (5049, 2), (3000, 1)):
        with pytest.raises(TransferError, match="outside the registered memory"):
            locate(regions, addr, nbytes)


def test_a_garbled_address_is_a_transfer_error() -> None:
    transport = make_transport("cuda_ipc")
    with pytest.raises(TransferError, match="cannot open"):
        transport.read("bm90IGpzb24=", [0], [0], [8])


def _kv_cache(seed: int, device: str) -> torch.Tensor:
    cpu = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    return cpu.to(device=device, dtype=torch.bfloat16)


def _serve_cache(conn: Connection) -> None:
    """The peer process: a random cache on cuda:1, its address, and a dump on request."""
    torch.cuda.set_device(1)
    transport = make_transport("cuda_ipc")
    kv = _kv_cache(seed=7, device="cuda:1")
    base = transport.register(kv)
    torch.cuda.synchronize()  # the cache is written before anyone reads it
    conn.send((transport.address, base))
    while conn.recv() == "dump":
        conn.send(kv.cpu())
    transport.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[tuple[Connection, str, int]]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_cache, args=(child,))
    proc.start()
    assert conn.poll(120), "the peer process did not report its address"
    address, base = conn.recv()
    yield conn, address, base
    conn.send("exit")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


@pytest.mark.gpu
@needs_two_gpus
def test_read_and_write_blocks_of_another_process(peer: tuple[Connection, str, int]) -> None:
    conn, address, peer_base = peer
    transport = make_transport("cuda_ipc")
    kv = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:0")
    base = transport.register(kv)

    src_ids, dst_ids = [3, 4, 5, 10, 11, 40, 63, 0], [7, 8, 9, 20, 22, 1, 2, 63]
    transport.read(address, *pair_regions(peer_base, base, BLOCK_BYTES, src_ids, dst_ids))
    conn.send("dump")
    source = conn.recv()
    got = kv.cpu()
    assert torch.equal(got[dst_ids], source[src_ids])
    assert not got[[b for b in range(SHAPE[0]) if b not in dst_ids]].any()

    kv.copy_(_kv_cache(seed=1, device="cuda:0"))
    src_ids, dst_ids = [0, 1, 2, 30], [50, 51, 52, 5]
    transport.write(address, *pair_regions(base, peer_base, BLOCK_BYTES, src_ids, dst_ids))
    conn.send("dump")
    after = conn.recv()
    assert torch.equal(after[dst_ids], kv.cpu()[src_ids])
    untouched = [b for b in range(SHAPE[0]) if b not in dst_ids]
    assert torch.equal(after[untouched], source[untouched])

    with pytest.raises(TransferError, match="outside the registered memory"):
        transport.read(address, [peer_base + SHAPE[0] * BLOCK_BYTES], [base], [8])
    transport.close()
