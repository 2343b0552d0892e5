"""Pins the listening sockets of a native library to one host address.

Mooncake Transfer Engine (0.3.13, and its source up to 2026-08) binds its two listeners, the
P2P handshake port and the TCP data port, to INADDR_ANY / in6addr_any with no setting to change
it (`MC_TCP_BIND_ADDRESS` only names the address it advertises). So while the library starts we
point its `bind` import (its GOT slot) at a wrapper that swaps a wildcard address for the host's,
then put the original back. `listening_sockets` reads /proc to check the result.
"""

from __future__ import annotations

import ctypes
import ipaddress
import mmap
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

_AF_INET, _AF_INET6 = socket.AF_INET, socket.AF_INET6
_PT_GNU_RELRO = 0x6474E552
_SHT_RELA = 4
_BIND = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, use_errno=True
)


class PinError(RuntimeError):
    """The library's `bind` could not be redirected."""


def resolve_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])


def loaded_libraries(under: str) -> list[str]:
    """The shared objects this process has mapped from files below the folder `under`."""
    prefix = os.path.realpath(under) + os.sep
    paths = {line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    return sorted(p for p in paths if p.startswith(prefix) and ".so" in p)


@contextmanager
def pinned_bind(libraries: Sequence[str], host: str) -> Iterator[None]:
    """While inside, wildcard binds made by `libraries` (loaded .so files) bind to `host`."""
    ip = resolve_ip(host)
    if ip.is_unspecified:  # the operator asked for every interface
        yield
        return
    slots = [s for s in map(_bind_slot, libraries) if s is not None]
    if not slots:
        raise PinError(f"none of {list(libraries)} imports `bind`")
    libc = ctypes.CDLL(None, use_errno=True)
    real = libc.bind
    real.argtypes, real.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32], ctypes.c_int
    v4 = ip.packed if ip.version == 4 else None
    v6 = ipaddress.IPv6Address(f"::ffff:{ip}").packed if v4 else ip.packed

    def bind(fd: int, addr: int | None, length: int) -> int:
        raw = bytearray(ctypes.string_at(addr, length)) if addr else bytearray()
        family = struct.unpack_from("=H", raw)[0] if len(raw) >= 2 else -1
        if family == _AF_INET and raw[4:8] == bytes(4):
            if v4 is None:  # an IPv6 host: an IPv4 wildcard would be wider than asked
                ctypes.set_errno(99)  # EADDRNOTAVAIL
                return -1
            raw[4:8] = v4
        elif family == _AF_INET6 and length >= 24 and raw[8:24] == bytes(16):
            raw[8:24] = v6  # a dual-stack socket takes the v4-mapped form of an IPv4 host
        buf = (ctypes.c_char * len(raw)).from_buffer(raw) if raw else None
        return real(fd, buf, length)

    hook = _BIND(bind)
    originals = [ctypes.c_void_p.from_address(slot).value for slot, _ in slots]
    try:
        for slot, relro in slots:
            _write_slot(slot, relro, ctypes.cast(hook, ctypes.c_void_p).value)
        yield
    finally:
        for (slot, relro), original in zip(slots, originals, strict=True):
            _write_slot(slot, relro, original)


def _bind_slot(library: str) -> tuple[int, bool] | None:
    """`library`'s GOT slot for `bind` and whether it lies in RELRO memory; None if it has none."""
    try:
        handle = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    except OSError as e:
        raise PinError(f"{library} is not loaded") from e
    base = ctypes.c_size_t.from_address(handle).value  # glibc: a handle is its link_map; l_addr
    data = Path(library).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise PinError(f"{library} is not a 64-bit ELF file")
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    offset = None
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != _SHT_RELA:
            continue
        symtab, strtab = sections[link], sections[sections[link][6]]
        for r in range(off, off + size, entsize or 24):
            r_offset, info = struct.unpack_from("<QQ", data, r)
            name_at = struct.unpack_from("<I", data, symtab[4] + (info >> 32) * 24)[0]
            start = strtab[4] + name_at
            if info >> 32 and data[start : data.index(b"\0", start)] == b"bind":
                offset = r_offset
    if offset is None:
        return None
    relro = False
    for i in range(phnum):
        kind, _, _, vaddr, _, _, memsz, _ = struct.unpack_from(
            "<IIQQQQQQ", data, phoff + i * phentsize
        )
        relro |= kind == _PT_GNU_RELRO and vaddr <= offset < vaddr + memsz
    return base + offset, relro


def _write_slot(slot: int, relro: bool, value: int | None) -> None:
    if relro:  # full RELRO: the GOT is read-only after loading; open it for this one write
        _protect(slot, mmap.PROT_READ | mmap.PROT_WRITE)
    ctypes.c_void_p.from_address(slot).value = value
    if relro:
        _protect(slot, mmap.PROT_READ)


def _protect(addr: int, prot: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    page = addr & ~(mmap.PAGESIZE - 1)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(page, mmap.PAGESIZE, prot) != 0:
        raise PinError(f"mprotect failed: {os.strerror(ctypes.get_errno())}")


def listening_sockets(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN that process `pid` holds (Linux /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: TCP_LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            # /proc prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(
                struct.pack("<I", int(hex_ip[i : i + 8], 16)) for i in range(0, width * 2, 8)
            )
            found.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found
