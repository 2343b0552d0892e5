"""Helpers for running real clients (AIPerf, `vllm bench serve`, OpenCode) against `ember up`.

    python benchmarks/clients.py slice TRACE OUT --rows 50 --max-input 16384 --max-output 16
        writes a Mooncake-trace slice that fits a CPU and prints its ideal prefix-hit ratio
    python benchmarks/clients.py counters URL [URL ...] > before.json
    python benchmarks/clients.py hits before.json URL [URL ...]
        the engines' prefix-cache hit ratio over what ran between the two calls
(`counters` and `hits` read each engine's internal `/load`: set EMBER_CLUSTER_SECRET.)

Prints what it measures; writes only the files named on its command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

from ember.trust import SECRET_ENV, internal_headers

MOONCAKE_BLOCK = 512  # tokens per hash_id in Mooncake's traces


def ideal_hit_ratio(rows: list[dict], block: int = MOONCAKE_BLOCK) -> float:
    """Prompt tokens an unbounded prefix cache would reuse, over all prompt tokens of `rows`
    (every request counted, whether or not it later completes)."""
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        ids, n = r["hash_ids"], r["input_length"]
        for i, h in enumerate(ids):
            size = block if i < len(ids) - 1 else n - block * (len(ids) - 1)
            total += size
            hit += size if h in seen else 0
        seen.update(ids)
    return hit / total if total else 0.0


def cut_slice(trace: Path, rows: int, max_input: int, max_output: int) -> list[dict]:
    """The first `rows` rows, less those longer than `max_input`, outputs capped."""
    out = []
    with trace.open() as f:
        for _, line in zip(range(rows), f, strict=False):
            r = json.loads(line)
            if r["input_length"] <= max_input:
                out.append({**r, "output_length": min(r["output_length"], max_output)})
    return out


def counters(urls: list[str]) -> dict[str, dict]:
    secret = os.environ.get(SECRET_ENV, "")
    keys = ("role", "prefix_cache_queries", "prefix_cache_hits", "remote_kv_loads")
    loads = {u: httpx.get(f"{u}/load", headers=internal_headers(secret), timeout=10) for u in urls}
    return {u: {k: r.json()[k] for k in keys} for u, r in loads.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slice")
    s.add_argument("trace", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--rows", type=int, default=50)
    s.add_argument("--max-input", type=int, default=16384)
    s.add_argument("--max-output", type=int, default=16)
    c = sub.add_parser("counters")
    c.add_argument("urls", nargs="+")
    h = sub.add_parser("hits")
    h.add_argument("before", type=Path)
    h.add_argument("urls", nargs="+")
    args = p.parse_args()
    if args.cmd == "slice":
        rows = cut_slice(args.trace, args.rows, args.max_input, args.max_output)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tokens = sum(r["input_length"] for r in rows)
        print(f"{len(rows)} rows, {tokens} prompt tokens, ideal hit {ideal_hit_ratio(rows):.2%}")
    elif args.cmd == "counters":
        json.dump(counters(args.urls), sys.stdout)
    else:
        before, after = json.loads(args.before.read_text()), counters(args.urls)
        for role in ("prefill", "decode", "both"):
            eps = [u for u in args.urls if after[u]["role"] == role]
            if not eps:
                continue
            q = sum(
                after[u]["prefix_cache_queries"] - before[u]["prefix_cache_queries"] for u in eps
            )
            hit = sum(after[u]["prefix_cache_hits"] - before[u]["prefix_cache_hits"] for u in eps)
            print(f"{role}: {hit}/{q} prompt tokens from the prefix cache ({hit / max(q, 1):.2%})")


if __name__ == "__main__":
    main()
