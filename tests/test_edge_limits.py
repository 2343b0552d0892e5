"""The limits both public faces put on a client's connections and request heads (`ember serve` and
`ember router`, the same flags): a head over --max-header-bytes or with more than --max-headers
lines is refused with an OpenAI error object and costs nothing else, a header line that never ends
is cut at the limit, and one client address cannot hold more than --max-connections-per-client
while another address is still served."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.servers import Server, start_router, start_server

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

LIMITS = ("--max-header-bytes", "8192", "--max-headers", "20", "--max-connections-per-client", "24")


@pytest.fixture(scope="module", params=["serve", "router"])
def face(request, tiny_model_dir) -> Iterator[Server]:
    model = tiny_model_dir("llama")
    if request.param == "serve":
        engine = start_server(model, "--cpu-threads", "1", *LIMITS)
        yield engine
        engine.stop()
        return
    engine = start_server(model, "--cpu-threads", "1")
    router = start_router(model, both=[engine], extra=LIMITS)
    yield router
    router.stop()
    engine.stop()


def address(face: Server) -> tuple[str, int]:
    host, port = face.url.removeprefix("http://").split(":")
    return host, int(port)


def send(face: Server, head: bytes, source: str | None = None) -> tuple[int, dict]:
    """Writes `head` (and the blank line ending it), returns the status and the JSON body."""
    s = socket.create_connection(
        address(face), timeout=20, source_address=(source, 0) if source else None
    )
    with s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head + b"\r\n")  # refused midway: the answer is already waiting
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    status_line, _, rest = data.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body) if body.startswith(b"{") else {}


def request_head(*headers: bytes) -> bytes:
    return b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + b"".join(
        h + b"\r\n" for h in headers
    )


def test_a_head_under_the_limits_is_served(face: Server) -> None:
    status, body = send(face, request_head(b"x-pad: " + b"a" * 2000))
    assert status == 200, body
    assert body["data"]


@pytest.mark.parametrize(
    "headers",
    [
        [b"x-pad-%d: %s" % (i, b"a" * 4000) for i in range(3)],  # 12 KB in three lines
        [b"x-many-%d: 1" % i for i in range(40)],  # 40 lines
        [b"x-pad: " + b"a" * 9000],  # one line longer than the whole limit
    ],
    ids=["bytes", "lines", "one-line"],
)
def test_a_head_over_the_limits_is_refused_with_an_error_object(face: Server, headers) -> None:
    status, body = send(face, request_head(*headers))
    assert status in (400, 431), body
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_a_header_that_never_ends_is_cut_at_the_limit(face: Server) -> None:
    """Before: `ember serve` buffered a 64 MB head whole (and stalled every stream meanwhile),
    waiting for its end until the header timeout. Now the server answers and closes as soon as
    the head passes the limit: within seconds, well before the header timeout (10 s and more)."""
    s = socket.create_connection(address(face), timeout=10)
    with s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-endless: ")
        t0 = time.monotonic()
        cut = False
        try:
            for _ in range(64):  # 1 MiB of one header value (the kernel buffers much of it)
                s.sendall(b"a" * 16384)
            s.settimeout(5)
            answer = s.recv(4096)  # an answer (431, or the router parser's 400), or the end
            cut = answer == b"" or answer.split(b" ")[1] in (b"400", b"431")
        except (BrokenPipeError, ConnectionResetError):
            cut = True  # closed with our bytes unread: the answer was lost to the reset
        except TimeoutError:
            cut = False
        assert cut, "the server took the header and went on waiting"
        assert time.monotonic() - t0 < 8
    assert httpx.get(f"{face.url}/health", timeout=5).status_code == 200


def test_one_client_address_cannot_take_every_connection(face: Server) -> None:
    held = [socket.create_connection(address(face), timeout=5) for _ in range(40)]
    try:
        time.sleep(0.3)
        refused = 0
        for s in held:
            s.settimeout(0.5)
            try:
                first = s.recv(4096)
            except TimeoutError:
                continue
            refused += first == b"" or first.startswith(b"HTTP/1.1 503")
        assert refused >= 40 - 24, refused
        # Another client (another loopback address) is still served meanwhile.
        status, body = send(face, request_head(), source="127.0.0.2")
        assert status == 200, body
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    status, _ = send(face, request_head())
    assert status == 200
