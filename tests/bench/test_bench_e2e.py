"""`ember bench` end to end against a real `ember serve` (tiny model, CPU): an agentic run, a
trace replay with its ideal hit ratio, a random run, and `ember bench compare`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import Server, start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[Server]:
    s = start_server(tiny_model_dir("llama"), "--max-model-len", "4096")
    yield s
    s.stop()


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ember.cli", "bench", *args, "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def result(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_agentic_run_completes_with_prefix_cache_hits(server: Server, tmp_path: Path) -> None:
    r = bench(
        "--url", server.url, "--workload", "agentic", "--sessions", "3", "--turns", "3",
        "--system-tokens", "300", "--max-tokens", "16", "--out", str(tmp_path), "--name", "agent",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    res = result(tmp_path, "agent")
    s = res["summary"]
    assert s["errors"] == 0 and s["completed"] == 9
    assert s["cache_hit_ratio"] > 0  # every turn resends the system prompt and the history
    assert {rec["session"] for rec in res["records"]} == {"ses_0", "ses_1", "ses_2"}
    assert all(rec["completion_tokens"] == 16 for rec in res["records"])
    assert (tmp_path / "agent-cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT" in (tmp_path / "agent.md").read_text() and "TTFT" in r.stdout


def test_trace_replay_reports_the_ideal_hit_ratio(server: Server, tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 4, "hash_ids": [0, 1]},
        {"timestamp": 100, "input_length": 900, "output_length": 4, "hash_ids": [0, 1, 2]},
        {"timestamp": 200, "input_length": 600, "output_length": 4, "hash_ids": [0, 3]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = bench(
        "--url", server.url, "--workload", "trace", "--trace-file", str(trace),
        "--out", str(tmp_path), "--name", "trace",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = result(tmp_path, "trace")["summary"]
    assert s["errors"] == 0 and s["completed"] == 3
    # Ideal: row 2 reuses row 1's 700 tokens, row 3 its first 512-token block.
    assert s["ideal_cache_hit_ratio"] == pytest.approx((700 + 512) / (700 + 900 + 600))
    # The engine caches whole 16-token blocks of what it has seen: close to the ideal, not over.
    assert 0 < s["cache_hit_ratio"] <= s["ideal_cache_hit_ratio"]


def test_trace_with_its_own_block_size(server: Server, tmp_path: Path) -> None:
    """--block-size: a trace of 16-token blocks is not read as one of 512 (the published traces').
    Hash ids no other test uses: the module's server must have cached none of these blocks."""
    rows = [
        {"timestamp": 0, "input_length": 64, "output_length": 2, "hash_ids": [90, 91, 92, 93]},
        {"timestamp": 100, "input_length": 64, "output_length": 2, "hash_ids": [90, 91, 95, 96]},
    ]
    trace = tmp_path / "trace16.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = bench(
        "--url", server.url, "--workload", "trace", "--trace-file", str(trace),
        "--block-size", "16", "--out", str(tmp_path), "--name", "t16",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s = result(tmp_path, "t16")["summary"]
    assert s["completed"] == 2 and s["trace_failed"] == 0
    # Row 2 shares 2 of its 4 blocks (32 tokens): the ideal, and what the engine (16-token blocks)
    # reports. Read as 512-token blocks, row 2 would repeat row 1 whole (ideal 50%).
    assert s["ideal_cache_hit_ratio"] == pytest.approx(32 / 128)
    assert s["sent_cache_hit_ratio"] == pytest.approx(32 / 128)
    assert "- cache hit over all 2 requests sent: 25.0% (ideal 25.0%); 0 failed" in r.stdout


def test_random_runs_and_compare(server: Server, tmp_path: Path) -> None:
    for name, rate in (("a", "50"), ("b", "20")):
        r = bench(
            "--url", server.url, "--workload", "random", "--num-requests", "6",
            "--input-len", "32:64", "--output-len", "8", "--rate", rate,
            "--out", str(tmp_path), "--name", name,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        s = result(tmp_path, name)["summary"]
        assert s["completed"] == 6 and s["completion_tokens"] == 48
    cmp = subprocess.run(
        [sys.executable, "-m", "ember.cli", "bench", "compare", str(tmp_path / "a.json"),
         str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cmp.returncode == 0, cmp.stderr
    assert "| a | b |" in cmp.stdout.replace("metric | ", "") or "a" in cmp.stdout
    assert "TTFT" in cmp.stdout


def test_rate_sweep_writes_one_summary_per_rate_and_the_load_plot(
    server: Server, tmp_path: Path
) -> None:
    r = bench(
        "--url", server.url, "--workload", "random", "--num-requests", "4",
        "--input-len", "32", "--output-len", "4", "--rates", "20,40",
        "--out", str(tmp_path), "--name", "sweep",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    sweep = result(tmp_path, "sweep")["sweep"]
    assert [s["rate"] for s in sweep] == [20.0, 40.0]
    assert all(s["summary"]["completed"] == 4 for s in sweep)
    # Each rate sends prompts of its own, or the later rates would measure a warm cache.
    assert sweep[1]["summary"]["cache_hit_ratio"] < 0.2
    assert (tmp_path / "sweep-sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_server(tiny_model_dir) -> Iterator[Server]:
    """The context `ember up` and the README's servers have (2,048 tokens)."""
    s = start_server(tiny_model_dir("llama"), "--max-model-len", "2048")
    yield s
    s.stop()


def test_readme_agentic_example_is_sized_to_a_2048_token_server(
    small_server: Server, tmp_path: Path
) -> None:
    """The README's agentic run (3,000-token system prompt, 256 tokens a turn) against a 2,048-token
    server is scaled to fit, with a warning, rather than having every request rejected."""
    r = bench(
        "--url", small_server.url, "--workload", "agentic", "--sessions", "2", "--turns", "4",
        "--out", str(tmp_path), "--name", "agent",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "does not fit the server's max_model_len 2048" in r.stderr
    res = result(tmp_path, "agent")
    assert res["summary"]["errors"] == 0 and res["summary"]["completed"] == 8
    assert all(rec["prompt_tokens"] + rec["completion_tokens"] <= 2048 for rec in res["records"])
    assert max(rec["prompt_tokens"] for rec in res["records"]) > 1024  # it fills, not starves


def test_readme_trace_example_is_cut_to_a_2048_token_server(
    small_server: Server, tmp_path: Path
) -> None:
    trace = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "traces"
    r = bench(
        "--url", small_server.url, "--workload", "trace", "--time-scale", "0",
        "--trace-file", str(trace / "mooncake_conversation_trace.jsonl"), "--max-requests", "4",
        "--out", str(tmp_path), "--name", "trace",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "did not fit the server's max_model_len 2048" in r.stderr
    s = result(tmp_path, "trace")["summary"]
    assert s["errors"] == 0 and s["completed"] == 4


def test_system_tokens_counts_the_servers_tokens(server: Server, tmp_path: Path) -> None:
    """`--system-tokens` counts the server's tokens, not words (1.7 tokens each for the tiny
    tokenizer)."""
    prompt = {}
    for n in (300, 900):
        r = bench(
            "--url", server.url, "--workload", "agentic", "--sessions", "1", "--turns", "1",
            "--system-tokens", str(n), "--max-tokens", "2", "--out", str(tmp_path), "--name", f"s{n}",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        prompt[n] = result(tmp_path, f"s{n}")["records"][0]["prompt_tokens"]
    assert prompt[900] - prompt[300] == pytest.approx(600, rel=0.1)


def test_exit_1_when_every_request_failed(server: Server, tmp_path: Path) -> None:
    """`ember bench` exits 1, not 0, when no request succeeded."""
    r = bench(
        "--url", server.url, "--workload", "random", "--num-requests", "3", "--input-len", "8",
        "--output-len", "2", "--model", "no-such-model", "--out", str(tmp_path),
    )  # fmt: skip
    assert r.returncode == 1
    assert "ember bench: error: all 3 requests failed, e.g. HTTP 404" in r.stderr
