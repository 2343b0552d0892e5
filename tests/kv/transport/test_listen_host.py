"""Mooncake's listeners bind to --kv-host only: not reachable through another local address."""

from __future__ import annotations

import errno
import ipaddress
import socket
from pathlib import Path

import pytest

from ember.kv.transport.listen_host import listening_sockets, pinned_bind


def _other_local_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine (the kernel's local routes), if any."""
    lines = Path("/proc/net/fib_trie").read_text().splitlines()
    for prev, line in zip(lines, lines[1:], strict=False):
        if "/32 host LOCAL" in line:
            addr = prev.split()[-1]
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    return None


def _connect(host: str, port: int) -> int:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port))


def test_pinned_bind_rewrites_wildcard_binds_of_a_library() -> None:
    import _socket

    lib = getattr(_socket, "__file__", None)
    if lib is None:
        pytest.skip("this Python links its socket module statically")
    with socket.socket() as s, socket.socket(socket.AF_INET6) as s6:
        with pinned_bind([lib], "127.0.0.1"):
            s.bind(("0.0.0.0", 0))
            s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s6.bind(("::", 0))
        assert s.getsockname()[0] == "127.0.0.1"
        assert s6.getsockname()[0] == "::ffff:127.0.0.1"
    with socket.socket() as s:  # the original bind is back
        s.bind(("0.0.0.0", 0))
        assert s.getsockname()[0] == "0.0.0.0"


def test_pinned_bind_keeps_the_error_of_a_failed_bind() -> None:
    import _socket

    lib = getattr(_socket, "__file__", None)
    if lib is None:
        pytest.skip("this Python links its socket module statically")
    with socket.socket() as taken, socket.socket() as s:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pinned_bind([lib], "127.0.0.1"), pytest.raises(OSError) as info:
            s.bind(("0.0.0.0", taken.getsockname()[1]))
    assert info.value.errno == errno.EADDRINUSE


def test_mooncake_listens_on_kv_host_only() -> None:
    pytest.importorskip("mooncake.engine", reason="the Mooncake wheel (extra 'pd-cpu') is missing")
    from ember.kv.transport.mooncake import MooncakeTransport

    before = listening_sockets()
    transport = MooncakeTransport("127.0.0.1")
    try:
        opened = listening_sockets() - before
        # Two listeners: the P2P handshake (the advertised port) and the TCP data port.
        assert len(opened) == 2, opened
        assert int(transport.address.rsplit(":", 1)[1]) in {port for _, port in opened}
        for addr, port in opened:
            ip = ipaddress.ip_address(addr)
            ip = getattr(ip, "ipv4_mapped", None) or ip
            assert ip == ipaddress.ip_address("127.0.0.1"), (addr, port)
            assert _connect("127.0.0.1", port) == 0
        other = _other_local_ipv4()
        if other is not None:  # the old code answered here: the KV was readable from outside
            for _, port in opened:
                assert _connect(other, port) == errno.ECONNREFUSED, (other, port)
    finally:
        transport.close()
