"""Agent sessions taking turns over a capped KV pool, against ember and vLLM: what the KV tiers and
their eviction keep when the sessions outnumber the cache.

N sessions of C tokens each (a system prompt and tool schemas shared by all, then the session's own
history) take turns round-robin; every turn resends the session's whole prompt plus `new` fresh
tokens and is answered with one token (`/v1/completions` with token ids, one request at a time).
Both servers' GPU pools are capped at the same number of tokens (ember `--num-kv-blocks`, vLLM
`--num-gpu-blocks-override`), so the sessions spill into what lies below: ember's host tier (its
eviction policy next-use or lru, or no tier), vLLM's native CPU offload (`--kv-offloading-size`,
GiB) or none. Each server runs the load right after it answers /health (`at-ready`: what a server
that starts under load meets), and, with `--idle-s S`, on a second start after sitting idle S
seconds (`after-idle`).

Per server, sessions and start: the hit ratio of rounds 2 on (prompt tokens the server reported
cached, `usage.prompt_tokens_details.cached_tokens`, over the tokens a turn could have hit: its
prompt less its new tokens), and the median seconds of a first and of a next turn.

    python benchmarks/agent_sessions.py [--sessions 8,16] [--context 16384] [--new 512]
        [--rounds 3] [--pool-tokens 100000] [--engines ember,ember-lru,ember-no-tier,vllm-offload,vllm]
        [--idle-s 45] [--shape llama]
    python benchmarks/agent_sessions.py --device cpu   # a smoke run on the tiny model

Prints a table and writes agent_sessions-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from result_names import result_path  # noqa: E402
from served_gpu import environment, model_dir, shape_config, start  # noqa: E402

from ember.cluster import stop_processes  # noqa: E402
from ember.kv.tiers.store_master import free_port  # noqa: E402

SHARED_TOKENS = 2048
"""The system prompt and tool schemas every session starts with (fewer on the CPU)."""
ENGINES = {
    "ember": [],
    "ember-lru": ["--kv-eviction", "lru"],
    "ember-no-tier": ["--kv-host-gb", "0"],
    "vllm": [],
    "vllm-offload": ["--kv-offloading-size", "32"],
}
"""The servers, by name: ember's host tier at its default size on a GPU (on the CPU the tier is
off unless `--host-gb`), vLLM with its native CPU offload of 32 GiB or none."""


def command(
    engine: str, model: str, port: int, device: str, pool_tokens: int, host_gb: float, max_len: int
) -> list[str]:
    """The server's command line, its GPU pool capped at `pool_tokens`, its context at
    `max_len`."""
    extra = list(ENGINES[engine]) + ["--max-model-len", str(max_len)]
    if engine.startswith("ember"):
        # Pages of 16 tokens on both servers, so the cap is the same number of blocks apart from
        # rounding.
        cmd = [sys.executable, "-P", "-m", "ember.cli", "serve", model, "--device", device]
        if device == "cuda":
            cmd += ["--load-format", "dummy"]
        if host_gb and engine != "ember-no-tier":
            extra += ["--kv-host-gb", str(host_gb)]
        return cmd + [
            "--block-size", "16", "--num-kv-blocks", str(pool_tokens // 16),
            "--port", str(port), "--served-model-name", "m", "--public-metrics", *extra,
        ]  # fmt: skip
    return [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
        "--load-format", "dummy", "--block-size", "16",
        "--num-gpu-blocks-override", str(pool_tokens // 16), "--enable-prompt-tokens-details",
        "--port", str(port), "--served-model-name", "m", *extra,
    ]  # fmt: skip


def host_tier(url: str, wait_s: float = 3.0) -> dict[str, float]:
    """ember's host tier from /metrics: its capacity (GiB) and hit ratio so far; {} when the
    server shows none within `wait_s` (the engine's first figures reach the API process a moment
    after ready)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            text = ""
        if "ember:kv_tier_capacity_bytes{" in text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = {}
    for line in text.splitlines():
        if 'medium="cpu"' not in line:
            continue
        if line.startswith("ember:kv_tier_capacity_bytes{"):
            out["capacity_gib"] = float(line.split()[-1]) / (1 << 30)
        elif line.startswith("ember:kv_tier_hit_ratio{"):
            out["hit_ratio"] = float(line.split()[-1])
    return out


def turn(url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to answer `prompt` with one token, and the prompt tokens the server had cached."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    req = urllib.request.Request(
        f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        usage = json.loads(r.read())["usage"]
    took = time.monotonic() - t0
    details = usage.get("prompt_tokens_details") or {}
    return took, int(details.get("cached_tokens") or 0)


def sessions_load(
    url: str, sessions: int, context: int, new: int, rounds: int, shared: int, vocab: int
) -> dict:
    """The round-robin load on one server: hit ratio from round 2 on, first and next turns."""
    rng = random.Random(sessions * 1_000_003 + context)
    system = [rng.randrange(10, vocab) for _ in range(shared)]
    prompts = [system + [rng.randrange(10, vocab) for _ in range(context - shared)]
               for _ in range(sessions)]  # fmt: skip
    first, nexts, hit, asked = [], [], 0, 0
    for r in range(rounds):
        for s in range(sessions):
            took, cached = turn(url, prompts[s])
            if r == 0:
                first.append(took)
            else:
                nexts.append(took)
                hit += cached
                asked += len(prompts[s]) - new
            prompts[s] = prompts[s] + [rng.randrange(10, vocab) for _ in range(new)]
    return {
        "hit_ratio": hit / max(asked, 1),
        "first_turn_s": statistics.median(first),
        "next_turn_s": statistics.median(nexts) if nexts else None,
        "next_turn_p90_s": sorted(nexts)[int(0.9 * (len(nexts) - 1))] if nexts else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="llama")
    ap.add_argument("--engines", default="ember,ember-lru,ember-no-tier,vllm-offload,vllm")
    ap.add_argument("--sessions", default="8,16")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool-tokens", type=int, default=100_000)
    ap.add_argument("--host-gb", type=float, default=0.0, help="ember's host tier (0: default)")
    ap.add_argument("--idle-s", type=float, default=0.0, help="also run after this idle (0: no)")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args()
    for engine in args.engines.split(","):
        if engine not in ENGINES:
            raise SystemExit(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    if args.device == "cpu":
        from ember.models.tiny import ensure_tiny

        model, gpu, vocab, shared = str(ensure_tiny("llama")), "cpu", 3000, 32
    else:
        import torch

        cfg = shape_config(args.shape, None, None)
        model, gpu = str(model_dir(args.shape, cfg)), torch.cuda.get_device_name()
        vocab, shared = min(cfg["vocab_size"], 120_000), SHARED_TOKENS
    work = Path(tempfile.mkdtemp(prefix="agent-sessions-"))
    report: dict = {"gpu": gpu, "shape": args.shape if args.device == "cuda" else "tiny-llama"}
    names = ("sessions", "context", "new", "rounds", "pool_tokens", "host_gb", "idle_s")
    report["load"] = {k: getattr(args, k) for k in names}
    report["runs"] = []
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out = result_path("agent_sessions", gpu, out_dir=out_dir)
    starts = ["at-ready"] + (["after-idle"] if args.idle_s else [])
    max_len = min(args.context + args.rounds * args.new + 64, args.pool_tokens)
    for engine in args.engines.split(","):
        for n in (int(x) for x in args.sessions.split(",")):
            for when in starts:
                port = free_port("127.0.0.1")
                url = f"http://127.0.0.1:{port}"
                log = work / f"{engine}-{n}-{when}.log"
                cmd = command(
                    engine, model, port, args.device, args.pool_tokens, args.host_gb, max_len
                )
                env = environment("vllm" if engine.startswith("vllm") else "ember", work / "caches")
                proc, ready_s = start(cmd, env, url, log, args.ready_timeout)
                try:
                    if when == "after-idle":
                        time.sleep(args.idle_s)
                    tier_at_start = host_tier(url) if engine.startswith("ember") else {}
                    run = sessions_load(url, n, args.context, args.new, args.rounds, shared, vocab)
                    run["host_tier_at_start"] = tier_at_start
                    run["host_tier_at_end"] = host_tier(url) if tier_at_start else {}
                finally:
                    stop_processes([proc], 30.0)
                run |= {"engine": engine, "sessions": n, "start": when, "ready_s": ready_s}
                report["runs"].append(run)
                out.write_text(json.dumps(report, indent=1))  # kept if the call is cut short
                print(
                    f"{engine:14s} {n:3d} sessions {when:10s}: hit ratio {run['hit_ratio']:.0%}, "
                    f"first turn {run['first_turn_s']:.3f} s, next {run['next_turn_s']:.3f} s",
                    flush=True,
                )
    print_table(report)
    print(f"wrote {out} (logs in {work})")


def print_table(report: dict) -> None:
    load = report["load"]
    print(
        f"\n## {report['gpu']}, {report['shape']}: sessions of {load['context']} tokens, "
        f"{load['new']} more a turn, round-robin over a {load['pool_tokens']}-token GPU pool\n"
    )
    print(
        "| server | sessions | load starts | hit ratio, rounds 2+ | first turn (s) | "
        "next turn (s) | host tier at the load's start (GiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in report["runs"]:
        gib = r.get("host_tier_at_start", {}).get("capacity_gib")
        print(
            f"| {r['engine']} | {r['sessions']} | {r['start']} | {r['hit_ratio']:.0%} | "
            f"{r['first_turn_s']:.3f} | {r['next_turn_s']:.3f} | "
            + (f"{gib:.2f} |" if gib is not None else "- |")
        )


if __name__ == "__main__":
    main()
