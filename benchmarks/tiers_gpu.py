"""KV tiers on one GPU, the Llama-3.1-8B shape with dummy bf16 weights (as benchmarks/engine_gpu.py).

Four measurements (`--parts`), against the issue's goals:

- host -> GPU loads through the engine's TierManager (2 GiB of blocks the manager offloaded, loaded
  back into other GPU blocks, contiguous and scattered), against a plain pinned host -> GPU copy of
  the same bytes timed in the same process (goal: >= 80% of it); the loaded bytes are checked;
- TTFT of a 32k-token prompt served from the host tier (sent again after two other 32k prompts
  evicted it from a GPU pool capped to one sequence), against recomputing it: the same prompt's
  first, cold, TTFT and the other prompts' (goal: >= 5x faster);
- TPOT at batch 64 (1k-token prompts) with the tiers on (the default host share, write-through
  of every computed block) against off, each in an engine of its own (goal: within 3%);
- agentic: benchmarks/pd_gpu.py's agent sessions against one `ember serve` whose GPU pool is capped
  to a quarter of the sessions' working set, with the host tier off and on (sized to hold it all):
  hit ratio, p50/p90 TTFT and output tok/s of each.

Each part runs in a fresh process (agentic: each run a fresh server). Prints a table, writes JSON
to
benchmarks/results/tiers_gpu-<GPU>-<date>.json (or $OUT/ when set). About 7 minutes on an H100; `--quick` runs
small sizes to check the script.

    python benchmarks/tiers_gpu.py [--quick] [--parts load,ttft,decode,agentic]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gpu import (  # noqa: E402
    SHAPES,
    Run,
    decode_steps,
    engine_config,
    kv_bytes_per_token,
    median_ms,
    random_prompts,
    shape_dir,
)
from benchmarks.pd_gpu import (  # noqa: E402
    OUTPUT_TOKENS,
    SECRET,
    SESSION_TOKENS,
    SYSTEM_TOKENS,
    TOOL_TOKENS,
    TokenAgent,
    model_dir,
    serve,
)
from benchmarks.result_names import result_path  # noqa: E402
from benchmarks.tiers_cpu import tier_counters  # noqa: E402
from ember.bench.metrics import summarize  # noqa: E402
from ember.bench.runner import RunLimits, run_sessions  # noqa: E402
from ember.cluster import stop_cluster, wait_healthy  # noqa: E402
from ember.engine.core import EngineCore  # noqa: E402
from ember.engine.messages import EngineCoreRequest  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from ember.kv.tiers import HostTier, TierManager

SHAPE = "llama"
GROW_TIMEOUT_S = 120.0
"""How long a part waits for the host tier to pin its memory (it grows in the background)."""
ALL = 1 << 62
"""`wait_grown`'s block count for "all the host tier will hold"."""
GiB = 1 << 30
BLOCK_SIZE = 16
"""The engines' KV block (`ember serve --block-size` default)."""
POOL_SHARE = 4
"""The agentic part's working set is this many times its GPU pool."""
AGENT_PORT = 18300
PARTS = {
    "load": ("load",),
    "ttft": ("ttft",),
    "decode": ("decode-off", "decode-on"),
    "agentic": ("agentic-off", "agentic-on"),
}
"""Each part of `--parts` and the child processes that measure it."""


@dataclass(frozen=True, slots=True)
class Sizes:
    prompt_len: int  # the long prompt of the TTFT part
    ttft_reps: int
    host_gb: float  # host tier of the load and TTFT parts
    load_blocks: int  # blocks per load of the bandwidth part
    load_reps: int
    batch: int  # the TPOT part
    decode_in: int
    decode_out: int
    agent_sessions: int  # the agentic part
    agent_turns: int
    agent_host_gb: float


FULL = Sizes(32768, 3, 16.0, 1024, 5, 64, 1024, 128, 48, 4, 32.0)
QUICK = Sizes(8192, 1, 4.0, 256, 2, 64, 512, 32, 12, 2, 4.0)


def wait_grown(host: HostTier, blocks: int, timeout_s: float = GROW_TIMEOUT_S) -> int:
    """Wait until the host tier holds `blocks` (or all it will); its capacity then."""
    target = min(blocks, getattr(host, "target_blocks", host.capacity_blocks))
    deadline = time.monotonic() + timeout_s
    while host.capacity_blocks < target and time.monotonic() < deadline:
        time.sleep(0.1)
    return host.capacity_blocks


def tiers_of(core: EngineCore) -> TierManager:
    if core.tiers is None:
        raise RuntimeError("the engine started without KV tiers")
    return core.tiers


# -- host -> GPU bandwidth ---------------------------------------------------------------------


def pinned_copy_ceiling(nbytes: int, device: torch.device) -> float:
    """Bytes per second of one plain copy of `nbytes` from pinned host memory to the GPU."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = median_ms(lambda: dst.copy_(src, non_blocking=True), iters=10)
    return nbytes / (ms / 1e3)


def timed_load(tiers: TierManager, load_id: str, keys: list[bytes], ids: list[int]) -> float:
    """Seconds from `start_load` until `poll_loads` reports it, as the engine sees a load."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tiers.start_load(load_id, keys, ids)
    while not (done := tiers.poll_loads()):
        pass
    seconds = time.perf_counter() - t0
    [(got_id, num_ok)] = done
    if got_id != load_id or num_ok != len(keys):
        raise RuntimeError(f"load {got_id} brought {num_ok} of {len(keys)} blocks")
    return seconds


def load_bandwidth(core: EngineCore, sizes: Sizes) -> dict[str, object]:
    """GPU blocks [0, n) filled with random bytes, offloaded to the host tier, then loaded back
    into [n, 2n) in order and in a shuffled order, `load_reps` times each."""
    tiers = tiers_of(core)
    gpu, n = tiers.gpu_blocks, sizes.load_blocks
    if gpu.shape[0] < 2 * n:
        raise ValueError(f"the KV pool has {gpu.shape[0]} blocks; the load part needs {2 * n}")
    # Wait for all of it: pinning more memory meanwhile would hold up the copies being timed.
    if wait_grown(tiers.host, ALL) < n:
        raise RuntimeError(f"the host tier did not reach {n} blocks in {GROW_TIMEOUT_S:.0f} s")
    gpu[:n].random_(0, 256)
    keys = [hashlib.sha256(f"tiers_gpu/{i}".encode()).digest() for i in range(n)]
    tiers.offload(list(enumerate(keys)))
    tiers.flush()
    if tiers.host.contains_prefix(keys) != n:
        raise RuntimeError("the host tier did not take every offloaded block")
    nbytes = n * gpu.shape[1]
    ceiling = pinned_copy_ceiling(nbytes, gpu.device)
    out: dict[str, object] = {"blocks": n, "bytes": nbytes, "ceiling_bytes_per_s": ceiling}
    g = torch.Generator().manual_seed(0)
    orders = {
        "contiguous": list(range(n, 2 * n)),
        "scattered": (torch.randperm(n, generator=g) + n).tolist(),
    }
    for name, ids in orders.items():
        rates = []
        for rep in range(sizes.load_reps):
            gpu[n : 2 * n].zero_()
            rates.append(nbytes / timed_load(tiers, f"bw-{name}-{rep}", keys, ids))
        rate = statistics.median(rates)
        out[name] = {
            "bytes_per_s": rate,
            "of_ceiling": rate / ceiling,
            "bytes_equal": bool(torch.equal(gpu[torch.tensor(ids, device=gpu.device)], gpu[:n])),
        }
    out["cost_model_bytes_per_s"] = tiers.cost.bandwidth("cpu")
    return out


# -- TTFT from host ----------------------------------------------------------------------------


def ttft(core: EngineCore, prompt: list[int], request_id: str) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one request sent to an idle core;
    steps on until the core is idle again (its blocks copied down to the host tier)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    core.add_request(EngineCoreRequest(request_id, prompt, params, [], max_tokens=1))
    first: tuple[float, int] | None = None
    while core.has_unfinished_requests():
        for o in core.step():
            if o.request_id == request_id and o.new_token_ids and first is None:
                first = (time.perf_counter() - t0, o.num_cached_tokens)
    if first is None:
        raise RuntimeError(f"request {request_id} produced no token")
    return first


def ttft_from_host(core: EngineCore, sizes: Sizes) -> dict[str, object]:
    """Per rep: prompt A cold, two other prompts (evicting A from the capped GPU pool), A again."""
    tiers = tiers_of(core)
    vocab, bs = core.model_config.vocab_size, core.config.block_size
    wait_grown(tiers.host, 3 * -(-sizes.prompt_len // bs))
    ttft(core, random_prompts(1, sizes.prompt_len, vocab, 99)[0], "warm-up")
    reps = []
    for rep in range(sizes.ttft_reps):
        a, *floods = random_prompts(3, sizes.prompt_len, vocab, 100 + rep)
        cold, _ = ttft(core, a, f"a{rep}")
        flooded = [ttft(core, p, f"flood{rep}-{i}")[0] for i, p in enumerate(floods)]
        hits = tiers.stats()["cpu"].hits
        warm, cached = ttft(core, a, f"a{rep}-again")
        loaded = (tiers.stats()["cpu"].hits - hits) * bs
        reps.append(
            {"recompute_s": [cold, *flooded], "host_s": warm, "cached_tokens": cached,
             "loaded_from_host_tokens": loaded, "gpu_hit_tokens": cached - loaded}
        )  # fmt: skip
    recompute = statistics.median(t for r in reps for t in r["recompute_s"])
    host = statistics.median(r["host_s"] for r in reps)
    return {
        "prompt_tokens": sizes.prompt_len,
        "recompute_ttft_ms": recompute * 1e3,
        "host_ttft_ms": host * 1e3,
        "speedup": recompute / host,
        "loaded_share": statistics.median(r["loaded_from_host_tokens"] for r in reps)
        / sizes.prompt_len,
        "reps": reps,
    }


# -- TPOT with offloading on and off -----------------------------------------------------------


def decode_tpot(core: EngineCore, sizes: Sizes) -> dict[str, object]:
    """The median step of `batch` requests all decoding (`decode_in` prompt tokens each)."""
    vocab, b = core.model_config.vocab_size, sizes.batch
    out: dict[str, object] = {"tiers": core.tiers is not None}
    if core.tiers is not None:
        out["host_blocks"] = wait_grown(core.tiers.host, ALL)  # steady state: all pinned
    run = Run(core)
    run(random_prompts(8, 256, vocab, 1), 8)  # warm-up
    before = core.tiers.stats()["cpu"] if core.tiers is not None else None
    res = run(random_prompts(b, sizes.decode_in, vocab, b), sizes.decode_out)
    steps = [s for s in decode_steps(res) if s[2] == b]
    if not steps:
        raise RuntimeError(f"no step had all {b} requests decoding")
    step = statistics.median(s[0] for s in steps)
    out |= {
        "batch": b,
        "tpot_ms": step * 1e3,
        "decode_steps": len(steps),
        "host_cpu_share": statistics.median(s[4] for s in steps) / step,
    }
    if core.tiers is not None and before is not None:
        after = core.tiers.stats()["cpu"]
        out["offloaded_blocks"] = after.blocks_in - before.blocks_in
        out["dropped_blocks"] = after.drops - before.drops
    return out


# -- an agentic load larger than the GPU pool -------------------------------------------------


def agent_prompt_len(turn: int) -> int:
    """Prompt tokens of a TokenAgent turn: the system prompt, the session's own tokens, then per
    turn an answer (stand-in ids) and a tool result."""
    return SYSTEM_TOKENS + SESSION_TOKENS + turn * (OUTPUT_TOKENS + TOOL_TOKENS)


def agent_working_set_blocks(sessions: int, turns: int) -> int:
    """KV blocks of every session at its last turn: the shared system prompt once, then per
    session its own prompt and the answers it decoded."""
    own = agent_prompt_len(turns - 1) - SYSTEM_TOKENS + turns * OUTPUT_TOKENS
    return -(-SYSTEM_TOKENS // BLOCK_SIZE) + sessions * -(-own // BLOCK_SIZE)


def agent_ideal_hit_ratio(turns: int) -> float:
    """Cached / prompt tokens were nothing evicted: turn 0 reuses the system prompt, a later turn
    the whole previous prompt (the answer's own tokens are not resent, stand-ins are)."""
    prompts = [agent_prompt_len(t) for t in range(turns)]
    cached = [SYSTEM_TOKENS, *prompts[:-1]]
    return sum(c // BLOCK_SIZE * BLOCK_SIZE for c in cached) / sum(prompts)


def wait_host_tier(url: str, host_gb: float, timeout_s: float = GROW_TIMEOUT_S) -> float:
    """Wait until the server's host tier has pinned (nearly) all `host_gb`; the GiB it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        gib = tier_counters(url, SECRET).get("cpu", {}).get("capacity_bytes", 0.0) / GiB
        if gib >= 0.99 * host_gb or time.monotonic() > deadline:
            return gib
        time.sleep(0.5)


def agentic(sizes: Sizes, host_gb: float) -> dict[str, object]:
    """pd_gpu's agent sessions, all started at once, against one `ember serve` on GPU 0 whose pool
    holds 1/POOL_SHARE of their working set, with a host tier of `host_gb` GiB (0: off)."""
    n, turns = sizes.agent_sessions, sizes.agent_turns
    working_set = agent_working_set_blocks(n, turns)
    need_gib = working_set * kv_bytes_per_token(SHAPES[SHAPE]) * BLOCK_SIZE / GiB
    if host_gb and need_gib > host_gb:
        raise ValueError(
            f"the sessions' working set is {need_gib:.1f} GiB; host tier {host_gb} GiB"
        )
    max_len = agent_prompt_len(turns - 1) + OUTPUT_TOKENS
    pool = max(working_set // POOL_SHARE, -(-max_len // BLOCK_SIZE))  # the engine needs one turn
    flags = [
        "--num-kv-blocks", str(pool), "--kv-host-gb", f"{host_gb:g}",
        "--max-model-len", str(max_len),
    ]  # fmt: skip
    t0 = time.perf_counter()
    server = serve(model_dir(), AGENT_PORT, 0, "both", flags)
    try:
        wait_healthy([server], 600)
        startup = time.perf_counter() - t0
        host_gib = wait_host_tier(server.url, host_gb) if host_gb else 0.0
        agent = TokenAgent(n, turns)
        records, wall = asyncio.run(run_sessions(server.url, agent, RunLimits(progress=False)))
        tiers = tier_counters(server.url, SECRET)
    finally:
        stop_cluster([server], 30)
    by_turn = {}
    for turn in range(turns):
        done = [r for r in records if r.ok and r.turn == turn]
        prompt = sum(r.prompt_tokens for r in done)
        by_turn[turn] = sum(r.cached_tokens for r in done) / prompt if prompt else None
    return {
        "sessions": n,
        "turns": turns,
        "pool_blocks": pool,
        "working_set_blocks": working_set,
        "working_set_gib": need_gib,
        "host_gb": host_gb,
        "host_gib_pinned": host_gib,
        "startup_s": startup,
        "ideal_hit_ratio": agent_ideal_hit_ratio(turns),
        "hit_ratio_by_turn": by_turn,
        "host_hit_tokens": int(tiers.get("cpu", {}).get("hits", 0)) * BLOCK_SIZE,
        "summary": summarize(records, wall),
        "tier_counters": tiers,
    }


# -- processes ---------------------------------------------------------------------------------


def child(task: str, sizes: Sizes) -> dict[str, object]:
    if task.startswith("agentic"):  # the server is the fresh process; this one only drives it
        return {"agentic": agentic(sizes, sizes.agent_host_gb if task == "agentic-on" else 0.0)}
    model = shape_dir(SHAPE)
    if task in ("load", "ttft"):
        seq_blocks = -(-(sizes.prompt_len + 128) // 16)
        config = engine_config(
            model,
            max_model_len=sizes.prompt_len + 128,
            num_kv_blocks=max(seq_blocks + 64, 2 * sizes.load_blocks),
            kv_host_gb=sizes.host_gb,
        )
    else:
        config = engine_config(model, kv_host_gb=None if task == "decode-on" else 0.0)
    t0 = time.perf_counter()
    core = EngineCore(config)
    out: dict[str, object] = {
        "startup_s": time.perf_counter() - t0,
        "kv_blocks": core.num_kv_blocks,
    }
    try:
        if task == "load":
            out["load"] = load_bandwidth(core, sizes)
        elif task == "ttft":
            out["ttft"] = ttft_from_host(core, sizes)
        else:
            out["decode"] = decode_tpot(core, sizes)
        if core.tiers is not None:
            out["tier_stats"] = {m: asdict(s) for m, s in core.tiers.stats().items()}
    finally:
        core.close()
    return out


def run_child(task: str, args: argparse.Namespace) -> dict:
    """Each part in a fresh process: the whole GPU, and a host tier pinned from scratch."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", task, "--child-out", f.name]
        cmd += ["--quick"] if args.quick else []
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def load_rows(load: dict) -> list[str]:
    gb = 1e9
    rows = [
        f"| pinned host -> GPU copy, {load['bytes'] / 2**30:.1f} GiB | "
        f"{load['ceiling_bytes_per_s'] / gb:.1f} GB/s | ceiling |"
    ]
    for name in ("contiguous", "scattered"):
        d = load[name]
        rows.append(
            f"| TierManager load, {load['blocks']} blocks {name} | {d['bytes_per_s'] / gb:.1f} "
            f"GB/s, {d['of_ceiling']:.2f} of the ceiling, bytes equal: {d['bytes_equal']} "
            "| >= 0.80 |"
        )
    return rows


def agentic_rows(off: dict, on: dict) -> list[str]:
    """One row per run (GPU only, + host tier), then the host tier's gains."""
    rows = []
    for name, a in (("GPU only", off), (f"+ host {on['host_gb']:g} GiB", on)):
        s = a["summary"]
        rows.append(
            f"| agentic, {a['sessions']} sessions x {a['turns']} turns, GPU pool "
            f"{a['pool_blocks']} of {a['working_set_blocks']} blocks, {name} | hit ratio "
            f"{s['cache_hit_ratio']:.1%} (ideal {a['ideal_hit_ratio']:.1%}), TTFT p50 "
            f"{s['ttft_ms']['p50']:.0f} / p90 {s['ttft_ms']['p90']:.0f} ms, "
            f"{s['output_throughput']:.0f} output tok/s, {s['errors']} errors | |"
        )
    s_off, s_on = off["summary"], on["summary"]
    rows.append(
        f"| agentic, host tier against GPU only | hit ratio "
        f"{ratio(s_on['cache_hit_ratio'], s_off['cache_hit_ratio']):.2f}x, TTFT p90 "
        f"{ratio(s_off['ttft_ms']['p90'], s_on['ttft_ms']['p90']):.2f}x lower, output tok/s "
        f"{ratio(s_on['output_throughput'], s_off['output_throughput']):.2f}x "
        f"({on['host_hit_tokens']} tokens from host) | hit ratio up, p90 TTFT down |"
    )
    return rows


def table(r: dict) -> str:
    """The rows of the parts that ran."""
    rows = ["| metric | value | goal |", "|---|---|---|"]
    if "load" in r:
        rows += load_rows(r["load"]["load"])
    if "ttft" in r:
        t = r["ttft"]["ttft"]
        rows.append(
            f"| TTFT {t['prompt_tokens']} tokens | from host {t['host_ttft_ms']:.0f} ms, "
            f"recomputed {t['recompute_ttft_ms']:.0f} ms: {t['speedup']:.1f}x "
            f"({t['loaded_share']:.0%} of the prompt loaded) | >= 5x |"
        )
    if "decode-on" in r:
        on, off = r["decode-on"]["decode"], r["decode-off"]["decode"]
        rows.append(
            f"| TPOT batch {on['batch']} | offloading on {on['tpot_ms']:.2f} ms, off "
            f"{off['tpot_ms']:.2f} ms: {on['tpot_ms'] / off['tpot_ms'] - 1:+.1%} "
            f"({on.get('offloaded_blocks', 0)} blocks offloaded) | within 3% |"
        )
    if "agentic-on" in r:
        rows += agentic_rows(r["agentic-off"]["agentic"], r["agentic-on"]["agentic"])
    return "\n".join(rows)


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"parts are {','.join(PARTS)}; got {text!r}")
    return [p for p in PARTS if p in parts]  # the script's order, each once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    ap.add_argument(
        "--parts",
        type=parse_parts,
        default=list(PARTS),
        help=f"which measurements, comma-separated (default: {','.join(PARTS)})",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, sizes), default=str))
        return
    gpu = torch.cuda.get_device_name()
    results: dict[str, object] = {"gpu": gpu, "torch": torch.__version__, "sizes": asdict(sizes)}
    for task in (t for part in args.parts for t in PARTS[part]):
        results[task] = run_child(task, args)
    print(f"GPU: {gpu}; {SHAPE} shape, dummy bf16 weights{' (quick)' if args.quick else ''}")
    print(table(results))
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    tag = ("quick" if args.quick else "") + (
        "" if args.parts == list(PARTS) else "-" + "+".join(args.parts)
    )
    out = result_path("tiers_gpu", gpu, tag=tag, out_dir=out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
