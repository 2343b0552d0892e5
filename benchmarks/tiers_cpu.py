"""KV tiers on the CPU: the prefix-cache hit ratio and TTFT of one engine whose KV pool is capped
small, with the tiers below it added one by one.

`ember bench --workload trace` replays a slice of the Mooncake conversation trace against one
`ember serve` of the tiny llama model (`--num-kv-blocks` caps its pool), four times: the pool
alone, + a host tier, + a disk tier, + a Mooncake Store tier (a `mooncake_master` started for
it); each configuration keeps the tiers of the one before, on a fresh engine, disk directory and
master. Reports the hit ratio (cached / prompt tokens), its share of the slice's ideal (an
unbounded prefix cache over the trace's hash_ids), TTFT p50/p90 and the blocks each tier served;
prints a table, writes JSON.

    python benchmarks/tiers_cpu.py [--window-min 6 --sessions 0.5 --span-s 150] [--eviction next-use,lru]

The slice: the trace's first `--window-min` minutes, whole conversations sampled (`--sessions`, a
share; a row continues the conversation whose earlier row its hash_ids extend), each hash id
standing for `--tokens-per-hash` tokens instead of 512 (prompts scaled down alike, so the trace's
sharing is kept), outputs capped, arrivals compressed to `--span-s` seconds. The tiers' sizes are
set so that each holds more than the one above (the host tier's 64 MiB is also the floor of its
staging share once disk or store is on, see ember/engine/kv_tiers.py), and the slice's working
set more than the host tier: on a larger one they would all hold everything.

On a 2-core machine the engine and the client share the cores with whatever else runs, so TTFT
(mostly queueing at this load) moves with that other work; the hit ratios hardly do.

Writes benchmarks/results/tiers_cpu-cpu-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_names import result_path  # noqa: E402
from ember.bench.report import format_number, format_percent  # noqa: E402
from ember.bench.workloads.mooncake import (  # noqa: E402
    MOONCAKE_BLOCK_SIZE,
    ideal_cached_tokens,
    read_mooncake_rows,
)
from ember.cluster import spawn, stop_cluster, wait_healthy  # noqa: E402
from ember.kv.tiers.store_master import StoreMaster, free_port, start_master  # noqa: E402
from ember.models.tiny import ensure_tiny  # noqa: E402
from ember.trust import SECRET_ENV, internal_headers, new_secret  # noqa: E402

TRACE = Path(__file__).resolve().parent / "data/traces/mooncake_conversation_trace.jsonl"
HOST = "127.0.0.1"
BLOCK_SIZE = 16
"""The engine's KV block (`ember serve --block-size` default)."""
MEDIA = ("cpu", "disk", "store")
TIER_FIELDS = ("hits", "misses", "blocks_in", "evictions", "drops", "errors", "corrupt",
               "loads", "recomputes", "occupancy_blocks", "capacity_bytes")  # fmt: skip
"""`ember:kv_tier_<field>{medium=...}` read from the engine's /metrics after each run."""


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """Which part of the trace is replayed, and how it is scaled down."""

    window_min: float
    sessions: float  # share of the conversations kept
    tokens_per_hash: int
    max_output: int
    seed: int


# -- the slice ---------------------------------------------------------------------------------


def conversations(rows: Sequence[dict]) -> list[int]:
    """A conversation id per row: a row whose hash_ids extend a prefix of two or more ids that an
    earlier row had continues that row's conversation (the first id, a system prompt every row
    of this trace shares, does not make one)."""
    children: dict[tuple[int, int], int] = {}  # (node, hash id) -> node; node 0: the root
    owner: list[int] = [-1]  # conversation of the row that made each node
    out: list[int] = []
    num_conversations = 0
    for row in rows:
        node, depth, found = 0, 0, -1
        for h in row["hash_ids"]:
            nxt = children.get((node, h))
            if nxt is None:
                break
            node, depth = nxt, depth + 1
            if depth >= 2:
                found = owner[node]
        if found < 0:
            found, num_conversations = num_conversations, num_conversations + 1
        out.append(found)
        for h in row["hash_ids"][depth:]:
            children[(node, h)] = node = len(owner)
            owner.append(found)
    return out


def trace_slice(rows: Sequence[dict], spec: SliceSpec) -> list[dict]:
    """The rows of the first `window_min` minutes from a seeded sample of whole conversations,
    prompts scaled to `tokens_per_hash` tokens per hash id, outputs capped."""
    rng = random.Random(spec.seed)
    keep: dict[int, bool] = {}
    out = []
    for row, conv in zip(rows, conversations(rows), strict=True):
        if row["timestamp"] >= spec.window_min * 60_000:
            break
        if conv not in keep:
            keep[conv] = rng.random() < spec.sessions
        if keep[conv]:
            n = math.ceil(row["input_length"] * spec.tokens_per_hash / MOONCAKE_BLOCK_SIZE)
            out.append(
                {**row, "input_length": max(1, n),
                 "output_length": max(1, min(row["output_length"], spec.max_output))}
            )  # fmt: skip
    return out


def ideal_ratio(path: Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> float:
    """An unbounded prefix cache's hit ratio over a trace file (bench's `ideal_cached_tokens`)."""
    rows = read_mooncake_rows(path, block_size=block_size)
    prompt = sum(r.input_length for r in rows)
    return sum(ideal_cached_tokens(rows, block_size=block_size)) / prompt if prompt else 0.0


# -- one configuration -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    host_gb: float = 0.0
    disk_gb: float | None = None  # None: no disk tier
    store_gb: float | None = None  # None: no store tier


def configs(args: argparse.Namespace) -> list[Config]:
    h, d, s = args.host_gb, args.disk_gb, args.store_gb
    return [
        Config("GPU pool only"),
        Config("+ host", h),
        Config("+ disk", h, d),
        Config("+ store", h, d, s),
    ]


@contextmanager
def store_master(on: bool) -> Iterator[StoreMaster | None]:
    master = start_master(HOST) if on else None
    try:
        yield master
    finally:
        if master is not None:
            master.stop()


def tier_counters(url: str, secret: str) -> dict[str, dict[str, float]]:
    """Per medium, the `ember:kv_tier_*` counters and gauges of the engine's /metrics."""
    text = httpx.get(f"{url}/metrics", headers=internal_headers(secret), timeout=10).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        field = family.name.removeprefix("ember:kv_tier_")
        if field == family.name or field not in TIER_FIELDS:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_created",)):
                continue
            out.setdefault(sample.labels["medium"], {})[field] = sample.value
    return out


def run_bench(url: str, slice_path: Path, args: argparse.Namespace, out_dir: Path) -> dict:
    """`ember bench --workload trace` on the slice; its summary."""
    cmd = [
        sys.executable, "-m", "ember.cli", "bench", "--url", url, "--workload", "trace",
        "--trace-file", str(slice_path), "--block-size", str(args.tokens_per_hash),
        "--time-scale", str(args.span_s / (args.window_min * 60)), "--timeout", "900",
        "--out", str(out_dir), "--name", "run", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ember bench failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads((out_dir / "run.json").read_text())["summary"]


def run_config(
    cfg: Config, model: str, slice_path: Path, args: argparse.Namespace, eviction: str
) -> dict:
    """A fresh engine (and disk directory and master) with `cfg`'s tiers and `eviction`, the
    slice replayed."""
    secret = new_secret()
    port = free_port(HOST)
    url = f"http://{HOST}:{port}"
    with (
        tempfile.TemporaryDirectory(prefix="ember-tiers-") as tmp,
        store_master(cfg.store_gb is not None) as master,
    ):
        flags = [
            "serve", model, "--host", HOST, "--port", str(port), "--device", "cpu",
            "--served-model-name", "tiny", "--max-model-len", str(args.max_model_len),
            "--num-kv-blocks", str(args.gpu_blocks), "--cpu-threads", str(args.cpu_threads),
            "--log-level", "warning", "--kv-host-gb", str(cfg.host_gb),
            "--kv-eviction", eviction,
        ]  # fmt: skip
        if cfg.disk_gb is not None:
            flags += ["--kv-disk-dir", str(Path(tmp) / "kv"), "--kv-disk-gb", str(cfg.disk_gb)]
        if master is not None and cfg.store_gb is not None:
            flags += ["--kv-store", master.address, "--kv-store-gb", str(cfg.store_gb)]
            flags += ["--kv-host", HOST]
        engine = spawn(cfg.name, url, flags, {SECRET_ENV: secret, "EMBER_API_KEY": ""})
        try:
            wait_healthy([engine], 300)
            t0 = time.perf_counter()
            summary = run_bench(url, slice_path, args, Path(tmp))
            wall = time.perf_counter() - t0
            tiers = tier_counters(url, secret)
        finally:
            stop_cluster([engine], 30)
    return {
        "config": asdict(cfg),
        "eviction": eviction,
        "wall_s": wall,
        "summary": summary,
        "tiers": tiers,
    }


# -- report ------------------------------------------------------------------------------------


def served_tokens(result: dict, medium: str, block_size: int) -> int:
    return int(result["tiers"].get(medium, {}).get("hits", 0)) * block_size


def table(results: list[dict], block_size: int) -> str:
    lines = [
        "| config | hit ratio | share of ideal | TTFT p50 (ms) | TTFT p90 (ms) "
        "| tokens from host / disk / store | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["summary"]
        ideal, sent = s.get("ideal_cache_hit_ratio"), s.get("sent_cache_hit_ratio")
        share = sent / ideal if ideal and sent is not None else None
        served = " / ".join(str(served_tokens(r, m, block_size)) for m in MEDIA)
        lines.append(
            f"| {r['config']['name']}, {r['eviction']} | {format_percent(s['cache_hit_ratio'])} "
            f"| {format_percent(share)} | {format_number(s['ttft_ms']['p50'], 1)} "
            f"| {format_number(s['ttft_ms']['p90'], 1)} | {served} | {s['errors']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--window-min", type=float, default=6.0, help="minutes of the trace replayed")
    ap.add_argument("--sessions", type=float, default=0.5, help="share of conversations kept")
    ap.add_argument("--tokens-per-hash", type=int, default=32, help="tokens a hash id stands for")
    ap.add_argument("--max-output", type=int, default=8, help="output tokens at most per request")
    ap.add_argument("--span-s", type=float, default=150.0, help="seconds the arrivals span")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-blocks", type=int, default=512, help="the capped pool, in blocks of 16")
    ap.add_argument("--host-gb", type=float, default=0.0625)
    ap.add_argument("--disk-gb", type=float, default=0.09375)
    ap.add_argument("--store-gb", type=float, default=0.25)
    ap.add_argument("--cpu-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--configs", default="0,1,2,3", help="which of the four to run, by index")
    ap.add_argument(
        "--eviction",
        default="next-use",
        help="the engines' --kv-eviction; several (next-use,lru) run each config under each",
    )
    args = ap.parse_args()
    if not 0 < args.sessions <= 1 or args.tokens_per_hash < 1 or args.span_s <= 0:
        ap.error("--sessions must lie in (0, 1], --tokens-per-hash >= 1, --span-s > 0")

    spec = SliceSpec(args.window_min, args.sessions, args.tokens_per_hash, args.max_output,
                     args.seed)  # fmt: skip
    whole = ideal_ratio(args.trace)
    rows = [json.loads(line) for line in args.trace.open() if line.strip()]
    chosen = trace_slice(rows, spec)
    model = str(ensure_tiny("llama"))
    results = []
    with tempfile.TemporaryDirectory(prefix="ember-slice-") as tmp:
        slice_path = Path(tmp) / "slice.jsonl"
        slice_path.write_text("".join(json.dumps(r) + "\n" for r in chosen))
        print(
            f"slice: {len(chosen)} requests, {sum(r['input_length'] for r in chosen)} prompt "
            f"tokens; whole trace's ideal hit ratio {whole:.2%}",
            file=sys.stderr,
        )
        for i in (int(x) for x in args.configs.split(",")):
            for eviction in args.eviction.split(","):
                cfg = configs(args)[i]
                print(f"{cfg.name}, {eviction} ...", file=sys.stderr, flush=True)
                results.append(run_config(cfg, model, slice_path, args, eviction))

    summary = results[0]["summary"]
    cpu = f"cpu-{platform.machine()}-{os.cpu_count()}cores"
    print(
        f"\n{summary['trace_requests']} requests of the Mooncake conversation trace "
        f"({args.window_min:g} min, {args.sessions:.0%} of conversations, "
        f"{args.tokens_per_hash} tokens per hash id), tiny llama, {args.gpu_blocks} KV blocks of "
        f"{BLOCK_SIZE} tokens, {cpu}; ideal hit ratio of the slice "
        f"{format_percent(summary['ideal_cache_hit_ratio'])}, of the whole trace {whole:.1%}"
    )
    print(table(results, BLOCK_SIZE))
    out = result_path("tiers_cpu", "cpu")
    body = {
        "slice": asdict(spec) | {"span_s": args.span_s, "requests": len(chosen),
                                 "prompt_tokens": sum(r["input_length"] for r in chosen)},
        "engine": {"max_model_len": args.max_model_len, "gpu_blocks": args.gpu_blocks,
                   "block_size": BLOCK_SIZE, "cpu_threads": args.cpu_threads},
        "whole_trace_ideal_hit_ratio": whole,
        "results": results,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
