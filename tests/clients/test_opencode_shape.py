"""OpenCode's request shape, recorded from the real client, replayed against `ember up`.

`opencode_session.json` holds three turns of one `opencode run` session (OpenCode 1.18.33 through
`scripts/record_proxy.py`): 10 tools, ~31 KB bodies, `max_tokens: 32000`, `stream_options.
include_usage`, `x-session-affinity` and `x-session-id`. Each turn must be a 200, turns 2 and 3
must report `cached_tokens` covering the turns before them, and the session's prefill legs must
land on one prefill engine (read from every engine's `/load` counters).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ember.cluster import get_load
from ember.up_process import up_process
from tests.servers import SECRET, free_port

FIXTURE = Path(__file__).with_name("opencode_session.json")
SERVED_NAME = "opencode-tiny"
MAX_MODEL_LEN = 32768  # what the OpenCode session ran with; its prompt is 11.1k tokens
PREFILL_ENGINES = 2  # two, so that "the session's prefill legs land on one engine" can fail
# The random tiny model decodes hundreds to thousands of tokens before it samples EOS (up to the
# ~21k the context leaves). Stop strings that match almost any token end each answer after a token
# or two (often the prefill leg's first); every other field, max_tokens 32000 included, is as
# OpenCode sent it.
STOP = [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", " ", "_"]


def up_has_flag(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "ember.cli", "up", "--help"], capture_output=True, text=True
    )
    return flag in out.stdout


@dataclass
class Cluster:
    url: str
    model: str
    named: bool
    prefill: list[str]
    decode: list[str]


def engine_load(url: str) -> dict:
    return get_load(url, SECRET, timeout_s=10)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model_dir = tiny_model_dir("llama")
    port, first = free_port(), free_port(run=PREFILL_ENGINES + 1)  # its engines, in a row
    named = up_has_flag("--served-model-name")
    flags = [
        "--engine-port", str(first), "--prefill", str(PREFILL_ENGINES),
        "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip
    if named:
        flags += ["--served-model-name", SERVED_NAME]
    log = tmp_path_factory.mktemp("opencode-up") / "stderr.log"
    engines = [f"http://127.0.0.1:{first + i}" for i in range(PREFILL_ENGINES + 1)]
    with up_process(str(model_dir), port, *flags, secret=SECRET, log=log, ready_timeout_s=240):
        yield Cluster(
            f"http://127.0.0.1:{port}",
            SERVED_NAME if named else str(model_dir),
            named,
            engines[:PREFILL_ENGINES],
            engines[PREFILL_ENGINES:],
        )


def stream_turn(url: str, turn: dict, model: str, session: str) -> tuple[int, dict | None, str]:
    """POSTs one recorded turn as OpenCode did; returns (status, the usage chunk's usage, text)."""
    body = {**turn["body"], "model": model, "stop": STOP}
    headers = {k: v for k, v in turn["headers"].items() if k != "authorization"}
    headers["x-session-affinity"] = headers["x-session-id"] = session
    usage, errors = None, []
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300
    ) as r:
        if r.status_code != 200:
            return r.status_code, None, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                errors.append(line)
            usage = chunk.get("usage") or usage
    return 200, usage, "\n".join(errors)


def test_fixture_is_opencode_shape() -> None:
    """The recorded turns carry what makes OpenCode's traffic hard (guards the fixture itself)."""
    turns = json.loads(FIXTURE.read_text())["turns"]
    assert len(turns) == 3
    for t in turns:
        body, headers = t["body"], t["headers"]
        assert len(body["tools"]) == 10
        assert len(json.dumps(body)) > 30_000
        assert body["max_tokens"] == 32000
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert headers["x-session-affinity"].startswith("ses_")
        assert headers["x-session-id"] == headers["x-session-affinity"]
        assert headers["authorization"] == "<redacted>"
    # Each turn extends the one before it: the same system prompt and tools, more messages.
    assert [len(t["body"]["messages"]) for t in turns] == [2, 4, 6]
    assert turns[1]["body"]["messages"][:2] == turns[0]["body"]["messages"]


@pytest.mark.slow
def test_opencode_session_turns(cluster: Cluster) -> None:
    turns = json.loads(FIXTURE.read_text())["turns"]
    engines = cluster.prefill + cluster.decode
    block_size = engine_load(engines[0])["block_size"]
    before = {e: engine_load(e) for e in engines}
    after_turn_1: dict[str, dict] = {}
    usages: list[dict] = []
    for n, turn in enumerate(turns, 1):
        status, usage, detail = stream_turn(cluster.url, turn, cluster.model, "ses_replay_1")
        assert status == 200, f"turn {n}: HTTP {status}: {detail}"
        assert not detail, f"turn {n}: error event: {detail}"
        assert usage is not None, f"turn {n}: no usage chunk despite include_usage"
        usages.append(usage)
        if n == 1:
            after_turn_1 = {e: engine_load(e) for e in engines}
    after = {e: engine_load(e) for e in engines}

    prompts = [u["prompt_tokens"] for u in usages]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages]
    assert prompts[0] > 10_000, prompts  # the long system prompt and tool schemas
    for n in (1, 2):
        # Every full block of the turn before is reused (its last partial block cannot be).
        assert cached[n] >= prompts[n - 1] - block_size, (prompts, cached)
        assert cached[n] <= prompts[n], (prompts, cached)

    # The prefill legs of the session ran on one prefill engine: only its counters moved.
    moved = [
        e
        for e in cluster.prefill
        if after[e]["prefix_cache_queries"] > before[e]["prefix_cache_queries"]
    ]
    assert len(moved) == 1, {e: (before[e], after[e]) for e in cluster.prefill}

    # Turns 2 and 3 recompute only their new tokens, not turn 1 again: on the prefill engines
    # (a decode engine's misses are read from the prefill engine, unless its read failed and it
    # prefilled the prompt itself, which `remote_kv_failures` counts).
    def misses(s: dict) -> int:
        return s["prefix_cache_queries"] - s["prefix_cache_hits"]

    recomputed = sum(misses(after[e]) - misses(after_turn_1[e]) for e in cluster.prefill)
    new_tokens = (prompts[1] - cached[1]) + (prompts[2] - cached[2])
    assert recomputed <= new_tokens + 2 * block_size, (recomputed, prompts, cached)
    fallbacks = [after[e]["remote_kv_failures"] - before[e]["remote_kv_failures"] for e in engines]
    assert sum(fallbacks) == 0, fallbacks


@pytest.mark.slow
def test_served_model_name(cluster: Cluster) -> None:
    if not cluster.named:
        pytest.skip("`ember up` has no --served-model-name yet")
    models = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    # A configured name is what OpenCode sends; the path it used to need is now an unknown model.
    turn = json.loads(FIXTURE.read_text())["turns"][0]
    status, _, detail = stream_turn(cluster.url, turn, "not-" + SERVED_NAME, "ses_replay_2")
    assert status == 404 and "model_not_found" in detail, (status, detail)
