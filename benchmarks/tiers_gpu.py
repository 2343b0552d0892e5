"""KV tiers on one GPU, the Llama-3.1-8B shape with dummy bf16 weights (as benchmarks/engine_gpu.py).

Three measurements, against the issue's goals:

- host -> GPU loads through the engine's TierManager (2 GiB of blocks the manager offloaded, loaded
  back into other GPU blocks, contiguous and scattered), against a plain pinned host -> GPU copy of
  the same bytes timed in the same process (goal: >= 80% of it); the loaded bytes are checked;
- TTFT of a 32k-token prompt served from the host tier (sent again after two other 32k prompts
  evicted it from a GPU pool capped to one sequence), against recomputing it: the same prompt's
  first, cold, TTFT and the other prompts' (goal: >= 5x faster);
- TPOT at batch 64 (1k-token prompts) with the tiers on (the default host share, write-through
  of every computed block) against off, each in an engine of its own (goal: within 3%).

Each part runs in a fresh process. Prints a table, writes JSON to $OUT (or benchmarks/results/)
named with the GPU. About 4 minutes on an H100; `--quick` runs small sizes to check the script.

    python benchmarks/tiers_gpu.py [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
    Run,
    decode_steps,
    engine_config,
    median_ms,
    random_prompts,
    shape_dir,
)
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


FULL = Sizes(32768, 3, 16.0, 1024, 5, 64, 1024, 128)
QUICK = Sizes(8192, 1, 4.0, 256, 2, 64, 512, 32)


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


# -- processes ---------------------------------------------------------------------------------


def child(task: str, sizes: Sizes) -> dict[str, object]:
    model_dir = shape_dir(SHAPE)
    if task == "load":
        seq_blocks = -(-(sizes.prompt_len + 128) // 16)
        config = engine_config(
            model_dir,
            max_model_len=sizes.prompt_len + 128,
            num_kv_blocks=max(seq_blocks + 64, 2 * sizes.load_blocks),
            kv_host_gb=sizes.host_gb,
        )
    else:
        config = engine_config(model_dir, kv_host_gb=None if task == "decode-on" else 0.0)
    t0 = time.perf_counter()
    core = EngineCore(config)
    out: dict[str, object] = {
        "startup_s": time.perf_counter() - t0,
        "kv_blocks": core.num_kv_blocks,
    }
    try:
        if task == "load":
            out["load"] = load_bandwidth(core, sizes)
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


def table(r: dict) -> str:
    load, t = r["load"]["load"], r["load"]["ttft"]
    on, off = r["decode-on"]["decode"], r["decode-off"]["decode"]
    gb = 1e9
    rows = [
        "| metric | value | goal |",
        "|---|---|---|",
        f"| pinned host -> GPU copy, {load['bytes'] / 2**30:.1f} GiB | "
        f"{load['ceiling_bytes_per_s'] / gb:.1f} GB/s | ceiling |",
    ]
    for name in ("contiguous", "scattered"):
        d = load[name]
        rows.append(
            f"| TierManager load, {load['blocks']} blocks {name} | {d['bytes_per_s'] / gb:.1f} "
            f"GB/s, {d['of_ceiling']:.2f} of the ceiling, bytes equal: {d['bytes_equal']} "
            "| >= 0.80 |"
        )
    rows.append(
        f"| TTFT {t['prompt_tokens']} tokens | from host {t['host_ttft_ms']:.0f} ms, recomputed "
        f"{t['recompute_ttft_ms']:.0f} ms: {t['speedup']:.1f}x ({t['loaded_share']:.0%} of the "
        "prompt loaded) | >= 5x |"
    )
    rows.append(
        f"| TPOT batch {on['batch']} | offloading on {on['tpot_ms']:.2f} ms, off "
        f"{off['tpot_ms']:.2f} ms: {on['tpot_ms'] / off['tpot_ms'] - 1:+.1%} "
        f"({on.get('offloaded_blocks', 0)} blocks offloaded) | within 3% |"
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, sizes), default=str))
        return
    gpu = torch.cuda.get_device_name()
    results: dict[str, object] = {"gpu": gpu, "torch": torch.__version__, "sizes": asdict(sizes)}
    for task in ("load", "decode-off", "decode-on"):
        results[task] = run_child(task, args)
    print(f"GPU: {gpu}; {SHAPE} shape, dummy bf16 weights{' (quick)' if args.quick else ''}")
    print(table(results))
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    tag = gpu.replace(" ", "_").replace("/", "_") + ("-quick" if args.quick else "")
    out = out_dir / f"tiers_gpu-{tag}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
