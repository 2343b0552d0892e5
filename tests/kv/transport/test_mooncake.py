"""Mooncake TE between real processes on loopback: one holds a KV cache, the other reads/writes it."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from ember.kv.transport import TransferError, block_regions, make_transport, pair_regions

if os.environ.get("CI") and sys.platform == "linux" and platform.machine() == "x86_64":
    import mooncake.engine  # noqa: F401  CI installs the wheel: a missing one fails, never skips
else:
    pytest.importorskip("mooncake.engine", reason="the Mooncake wheel (extra 'pd-cpu') is missing")

from ember.kv.transport.mooncake import MooncakeTransport  # noqa: E402

# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: ember's KV layout.
SHAPE = (64, 2, 2, 16, 2, 8)
BLOCK_BYTES = SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * SHAPE[5] * 4
Local = tuple[MooncakeTransport, torch.Tensor, int]


def _kv_cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _serve_cache(conn: Connection) -> None:
    """The peer process: registers a random cache, reports (address, base), dumps it on request."""
    transport = make_transport("mooncake")
    kv = _kv_cache(seed=7)
    conn.send((transport.address, transport.register(kv)))
    while conn.recv() == "dump":
        conn.send(kv.clone())
    transport.close()


class Peer:
    def __init__(self) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_serve_cache, args=(child,))
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("the peer process did not report its address")
        self.address, self.base = self.conn.recv()

    def dump(self) -> torch.Tensor:
        self.conn.send("dump")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("exit")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local_transport() -> Iterator[Local]:
    transport = MooncakeTransport(timeout_s=10.0)
    kv = torch.zeros(SHAPE)
    base = transport.register(kv)
    yield transport, kv, base
    transport.close()


@pytest.fixture
def local(local_transport: Local) -> Local:
    local_transport[1].zero_()
    return local_transport


def test_read_moves_listed_blocks_and_nothing_else(peer: Peer, local: Local) -> None:
    transport, kv, base = local
    src_ids = [3, 4, 5, 10, 11, 40, 63, 0]
    dst_ids = [7, 8, 9, 20, 22, 1, 2, 63]
    srcs, dsts, lens = pair_regions(peer.base, base, BLOCK_BYTES, src_ids, dst_ids)
    assert len(lens) == 6  # 3,4,5 -> 7,8,9 is one region; 10,11 -> 20,22 is two
    transport.read(peer.address, srcs, dsts, lens)
    source = peer.dump()
    assert torch.equal(kv[dst_ids], source[src_ids])
    untouched = [b for b in range(SHAPE[0]) if b not in dst_ids]
    assert not kv[untouched].any()


def test_write_lands_in_peer_blocks_and_nothing_else(peer: Peer, local: Local) -> None:
    transport, kv, base = local
    kv.copy_(_kv_cache(seed=1))
    before = peer.dump()
    src_ids = [0, 1, 2, 30, 31]
    dst_ids = [50, 51, 52, 5, 60]
    transport.write(peer.address, *pair_regions(base, peer.base, BLOCK_BYTES, src_ids, dst_ids))
    after = peer.dump()
    assert torch.equal(after[dst_ids], kv[src_ids])
    untouched = [b for b in range(SHAPE[0]) if b not in dst_ids]
    assert torch.equal(after[untouched], before[untouched])


def test_many_regions_in_one_batch(peer: Peer, local: Local) -> None:
    transport, kv, base = local
    ids = list(range(0, SHAPE[0], 2))  # every other block: 32 regions, none merged
    regions = block_regions(peer.base, BLOCK_BYTES, ids)
    assert len(regions) == 32
    locals_ = [a for a, _ in block_regions(base, BLOCK_BYTES, ids)]
    transport.read(peer.address, [a for a, _ in regions], locals_, [n for _, n in regions])
    assert torch.equal(kv[ids], peer.dump()[ids])


def test_address_outside_peer_memory_raises(peer: Peer, local: Local) -> None:
    transport, _, base = local
    past_end = peer.base + SHAPE[0] * BLOCK_BYTES - 8
    with pytest.raises(TransferError, match="failed"):
        transport.read(peer.address, [past_end], [base], [BLOCK_BYTES])


def test_bad_batches_and_tensors_are_refused(local: Local) -> None:
    transport, _, base = local
    with pytest.raises(ValueError, match="differ in length"):
        transport.read("127.0.0.1:1", [base, base], [base], [8])
    with pytest.raises(ValueError, match="contiguous"):
        transport.register(torch.zeros(4, 4).t())
    transport.read("127.0.0.1:1", [], [], [])  # an empty batch moves nothing and asks no peer


def test_dead_or_missing_peer_raises_quickly(local: Local) -> None:
    transport, _, base = local
    dead = Peer()
    transport.read(dead.address, [dead.base], [base], [BLOCK_BYTES])  # connected while alive
    dead.proc.kill()
    dead.proc.join()
    for address in (dead.address, "127.0.0.1:1"):
        start = time.monotonic()
        with pytest.raises(TransferError):
            transport.read(address, [dead.base], [base], [BLOCK_BYTES])
        assert time.monotonic() - start < 5


def test_silent_peer_times_out_instead_of_hanging() -> None:
    # Accepts the handshake's connection and never answers: the library would wait ~60 s.
    listener = socket.create_server(("127.0.0.1", 0))
    transport = MooncakeTransport(timeout_s=1.0)
    kv = torch.zeros(SHAPE)
    base = transport.register(kv)
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="did not finish"):
            transport.read(f"127.0.0.1:{listener.getsockname()[1]}", [base], [base], [8])
        assert time.monotonic() - start < 3
    finally:
        listener.close()  # resets the pending connection, so the library's call ends too
        _wait_idle(transport)
        transport.close()


def _wait_idle(transport: Any, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while transport._workers._busy and time.monotonic() < deadline:
        time.sleep(0.05)


def test_start_prints_no_benign_error_lines() -> None:
    """`ember serve` used to greet its user with Mooncake's E-level "Local segment descriptor not
    found" at every start (and W-level noise about RDMA on a TCP set-up): it means nothing."""
    import subprocess

    code = "from ember.kv.transport import make_transport; make_transport('mooncake').close()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "Local segment descriptor not found" not in run.stderr
    assert not [line for line in run.stderr.splitlines() if line[:1] == "E"], run.stderr


def test_the_start_filter_passes_on_every_other_line(capfd: pytest.CaptureFixture[str]) -> None:
    from ember.kv.transport.mooncake import _start_log_filtered

    with _start_log_filtered("tcp"):
        os.write(2, b"E1126 transfer_metadata.cpp:1098] Local segment descriptor not found\n")
        os.write(2, b"E1126 tcp_transport.cpp:1] a real failure\n")
        os.write(2, b"W1126 topology.cpp:201] No RDMA devices found\n")
    err = capfd.readouterr().err
    assert err == "E1126 tcp_transport.cpp:1] a real failure\n"
    with _start_log_filtered("rdma"):
        os.write(2, b"W1126 topology.cpp:201] No RDMA devices found\n")
    assert "No RDMA devices found" in capfd.readouterr().err  # news on an RDMA set-up
