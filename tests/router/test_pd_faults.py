"""Faults in a disaggregated cluster, real processes on loopback: a client that hangs up, a lease
nobody reads, a prefill engine that dies, a decode engine that dies mid-stream. The tests run in
file order on one cluster: the last two kill its engines."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from ember.trust import internal_headers
from ember.up_process import drained, wait_drained
from tests.router.test_pd import ENGINE, chat_body, long_text, post
from tests.servers import SECRET, PDCluster, pd_cluster, start_server

INTERNAL = internal_headers(SECRET)
"""Calls that stand in for ember's own processes (KV transfer parameters, /metrics)."""

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(llama: Path) -> Iterator[PDCluster]:
    with pd_cluster(llama, *ENGINE) as c:
        yield c


def test_client_hang_up_frees_blocks_on_both_sides(cluster: PDCluster) -> None:
    body = {**chat_body(long_text(30, 300), max_tokens=1000), "stream": True}
    with httpx.stream(
        "POST", f"{cluster.router.url}/v1/chat/completions", json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 5:
                break
    # The client is gone mid-stream: both legs' blocks must come back.
    busy = {s.url: s.load()["running"] for s in cluster.engines()}
    state = wait_drained([s.url for s in cluster.engines()], SECRET, 10)
    assert all(drained(st) for st in state.values()), state
    assert sum(busy.values()) <= 1  # it was still decoding when the client left (or just ended)


def test_expired_lease_frees_blocks_and_decode_prefills_locally(
    cluster: PDCluster, llama: Path
) -> None:
    prefill = start_server(llama, *ENGINE, "--role", "prefill", "--kv-lease-s", "1")
    try:
        body = chat_body(long_text(31, 300))
        leg = post(
            prefill,
            "/chat/completions",
            {**body, "kv_transfer_params": {"do_remote_decode": True}},
            INTERNAL,
        )
        kvp = leg["kv_transfer_params"]
        assert kvp["lease_id"] and kvp["block_ids"] and kvp["first_token_id"] >= 0
        held = prefill.load()
        assert held["leases"] == 1 and held["free_blocks"] < held["total_blocks"]
        time.sleep(1.6)
        after = wait_drained([prefill.url], SECRET, 5)[prefill.url]
        assert after["leases"] == 0 and after["lease_expiries"] == 1
        assert after["free_blocks"] == after["total_blocks"]
        metrics = httpx.get(f"{prefill.url}/metrics", headers=INTERNAL).text
        assert "ember:kv_lease_expiries_total" in metrics
        # A decode leg that comes too late must not trust those blocks: it prefills locally.
        before = cluster.decode.load()
        late = {**body, "kv_transfer_params": {**kvp, "do_remote_prefill": True}}
        got = post(cluster.decode, "/chat/completions", late, INTERNAL)
        want = post(cluster.decode, "/chat/completions", body)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert cluster.decode.load()["remote_kv_failures"] == before["remote_kv_failures"] + 1
    finally:
        prefill.stop()


def test_killed_prefill_engine_is_routed_around(cluster: PDCluster) -> None:
    cluster.prefill[0].proc.kill()
    cluster.prefill[0].proc.wait(10)
    for i in range(4):  # at once, before the router's health poll has noticed
        headers = {"x-session-affinity": f"ses_{i}"}
        out = post(cluster.router, "/chat/completions", chat_body(long_text(40 + i, 300)), headers)
        assert out["usage"]["completion_tokens"] == 20


def test_killed_decode_engine_ends_the_stream_with_an_error(cluster: PDCluster) -> None:
    body = {**chat_body(long_text(50, 300), max_tokens=1000), "stream": True}
    lines: list[str] = []
    with httpx.stream(
        "POST", f"{cluster.router.url}/v1/chat/completions", json=body, timeout=30
    ) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        for line in it:
            lines.append(line)
            if sum(ln.startswith("data: {") for ln in lines) >= 5:
                break
        cluster.decode.proc.kill()
        t0 = time.monotonic()
        lines.extend(it)
        elapsed = time.monotonic() - t0
    data = [ln for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    err = orjson.loads(data[-2][6:])
    assert "error" in err and err["error"]["message"]
    assert elapsed < 10
