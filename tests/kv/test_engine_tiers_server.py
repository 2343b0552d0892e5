"""`ember serve --kv-host-gb` end to end: a session evicted from a small device pool is served
from host memory (usage's cached_tokens counts it), /load shows the tier's occupancy, /metrics its
`ember:kv_tier_*` counters, and /kv_events gives each event's medium when asked (and the plain
GPU events, as before, when not)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from ember.trust import internal_headers
from tests.servers import SECRET, Server, start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[Server]:
    s = start_server(
        tiny_model_dir("llama"), "--cpu-threads", "1", "--num-kv-blocks", "64",
        "--kv-host-gb", "0.05",
    )  # fmt: skip
    yield s
    s.stop()


def complete(server: Server, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def internal(server: Server, path: str, **params: str) -> httpx.Response:
    return httpx.get(
        f"{server.url}{path}", params=params, headers=internal_headers(SECRET), timeout=10
    )


def metric(text: str, name: str, medium: str) -> float:
    """The value of `name{..., medium=...}` in a Prometheus exposition."""
    values = [
        float(line.split()[-1]) for line in text.splitlines()
        if line.startswith(name + "{") and f'medium="{medium}"' in line
    ]  # fmt: skip
    assert len(values) == 1, (name, medium, values)
    return values[0]


def test_an_evicted_session_is_served_from_host_and_shows_in_load_metrics_events(
    server: Server,
) -> None:
    rng = random.Random(0)
    a, b = ([rng.randrange(10, 3000) for _ in range(800)] for _ in range(2))
    complete(server, a)
    complete(server, b)  # 50 of the pool's 64 blocks: most of a's are evicted
    again = complete(server, a)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 49 * 16

    tiers = server.load()["kv_tiers"]
    assert set(tiers) == {"cpu"}
    assert tiers["cpu"]["blocks"] >= 2 * 50 - 2 and tiers["cpu"]["capacity_bytes"] > 0

    metrics = internal(server, "/metrics").text
    hits = metric(metrics, "ember:kv_tier_hits_total", "cpu")
    # b's lookup found nothing past the GPU hit: a miss each of its blocks (a's first turn
    # found the pool empty and the tier too: more).
    misses = metric(metrics, "ember:kv_tier_misses_total", "cpu")
    assert hits > 0 and misses >= 49
    ratio = metric(metrics, "ember:kv_tier_hit_ratio", "cpu")
    assert ratio == pytest.approx(hits / (hits + misses))
    overall = [
        line for line in metrics.splitlines() if line.startswith("ember:prefix_cache_hit_ratio{")
    ]
    assert len(overall) == 1 and 0 < float(overall[0].split()[-1]) < 1
    assert metric(metrics, "ember:kv_tier_occupancy_blocks", "cpu") == tiers["cpu"]["blocks"]

    plain = internal(server, "/kv_events", since="0").json()["events"]
    assert plain and all(len(e) == 2 for e in plain)  # the format routers read today
    labeled = internal(server, "/kv_events", since="0", medium="all").json()["events"]
    assert len(labeled) >= len(plain) and all(len(e) == 3 for e in labeled)
    assert [e[:2] for e in labeled if e[2] == "gpu"] == plain
    assert any(e[0] == "stored" and e[2] == "cpu" for e in labeled)  # the host tier's
    bad = internal(server, "/kv_events", medium="tape")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "medium"
