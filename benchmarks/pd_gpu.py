"""Colocated against disaggregated on two GPUs, Llama-3.1-8B shape (dummy bf16 weights), under a
multi-turn agentic load, on a 2-GPU device machine (`kind: nvidia-h100-x2`).

- colocated: two `ember serve --role both` engines, one per GPU, behind `ember router`;
- disaggregated: a prefill engine on GPU 0 and a decode engine on GPU 1 (KV over CUDA IPC),
  behind `ember router`.

The load: S agent sessions at once, T turns each; a turn resends a shared system prompt (tools),
the session's history and a new tool result as token ids to /v1/completions, streamed, greedy,
`ignore_eos`, with `x-session-affinity`. Reports p50/p90 TTFT and TPOT, output tok/s, the cache
hit ratio, and for PD the KV transfer rate and its share of TTFT. Prints a table, writes JSON.

    python benchmarks/pd_gpu.py [--sessions 32 --turns 4]

Writes benchmarks/results/pd_gpu-2x<GPU>-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gpu import SHAPES  # noqa: E402
from benchmarks.result_names import hardware_label, result_path  # noqa: E402
from ember.bench.compare import compare_table  # noqa: E402
from ember.bench.metrics import summarize  # noqa: E402
from ember.bench.records import PlannedRequest  # noqa: E402
from ember.bench.runner import RunLimits, run_sessions  # noqa: E402
from ember.cluster import Proc, spawn, stop_cluster, wait_healthy, wait_routed  # noqa: E402
from ember.models.tiny import make_tiny  # noqa: E402
from ember.trust import SECRET_ENV, internal_headers, new_secret  # noqa: E402

SECRET = new_secret()
"""The cluster secret of this run's engines and router (their /load answers only with it)."""

SYSTEM_TOKENS = 2048
SESSION_TOKENS = 1024
TOOL_TOKENS = 1024
OUTPUT_TOKENS = 128


def model_dir() -> str:
    """The 8B shape's config with the tiny model's tokenizer (the weights are dummy)."""
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(SHAPES["llama"]))
    tiny = make_tiny(Path(tempfile.mkdtemp()), "llama")
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, d / f.name)
    return str(d)


def serve(model: str, port: int, gpu: int, role: str, extra: Sequence[str] = ()) -> Proc:
    """`ember serve` of the 8B shape with dummy weights on one GPU; `extra` flags come last, so
    they override the ones here (argparse keeps the last)."""
    args = [
        "serve", model, "--port", str(port),
        "--device", "cuda", "--load-format", "dummy", "--dtype", "bfloat16",
        "--max-model-len", "16384", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.85",
        "--role", role, "--kv-transport", "cuda_ipc", "--served-model-name", "llama-8b",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    env = {"CUDA_VISIBLE_DEVICES": str(gpu), SECRET_ENV: SECRET}
    return spawn(f"{role}@gpu{gpu}", f"http://127.0.0.1:{port}", args, env)


def router(model: str, port: int, engines: dict[str, list[str]]) -> Proc:
    args = ["router", "--port", str(port), "--model", model]
    args += ["--poll-interval", "0.2", "--log-level", "warning"]
    for role, urls in engines.items():
        args += [f"--{role}", *urls]
    return spawn("router", f"http://127.0.0.1:{port}", args, {SECRET_ENV: SECRET})


@dataclass(slots=True)
class TokenAgent:
    """Agent sessions as token ids (runner.SessionWorkload): a shared 2,048-token system prompt,
    the session's 1,024 tokens, then per turn the answer (stand-in ids) and a 1,024-token tool
    result, sent to /v1/completions."""

    sessions: int
    turns: int
    affinity: bool = True
    think_time_s: float = 0.0

    def session_start(self, session_idx: int) -> float:
        return 0.0

    def first(self, session_idx: int) -> PlannedRequest:
        shared = random.Random(0)
        ids = [shared.randrange(10, 3000) for _ in range(SYSTEM_TOKENS)]
        ids += self._ids(session_idx, 0, SESSION_TOKENS)
        return self._request(session_idx, 0, ids)

    def next(self, prev: PlannedRequest, answer_text: str) -> PlannedRequest | None:
        sid, turn = int(prev.request_id.split("-")[0].removeprefix("ses_")), prev.turn + 1
        if turn >= self.turns:
            return None
        ids = prev.body["prompt"] + self._ids(sid, turn, OUTPUT_TOKENS + TOOL_TOKENS)
        return self._request(sid, turn, ids)

    @staticmethod
    def _ids(sid: int, turn: int, n: int) -> list[int]:
        rng = random.Random(sid * 1000 + turn)
        return [rng.randrange(10, 3000) for _ in range(n)]

    @staticmethod
    def _request(sid: int, turn: int, ids: list[int]) -> PlannedRequest:
        body = {"model": "llama-8b", "prompt": ids, "max_tokens": OUTPUT_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        return PlannedRequest(
            f"ses_{sid}-{turn}", "/v1/completions", body, session=f"ses_{sid}", turn=turn
        )


@contextlib.contextmanager
def cluster(model: str, engines: list[tuple[str, int]], port: int) -> Iterator[list[str]]:
    """Engines (role, GPU) and a router on `port`; yields the engine urls, router first."""
    procs: list[Proc] = []
    by_role: dict[str, list[str]] = {}
    for i, (role, gpu) in enumerate(engines):
        procs.append(serve(model, port + 1 + i, gpu, role))
        by_role.setdefault(role, []).append(procs[-1].url)
    try:
        wait_healthy(procs, 600)
        procs.append(router(model, port, by_role))
        wait_healthy(procs, 60)
        wait_routed(procs[-1].url, SECRET)
        yield [procs[-1].url, *(p.url for p in procs[:-1])]
    finally:
        stop_cluster(procs, 30)


def sweep(name: str, model: str, engines: list[tuple[str, int]], args: argparse.Namespace) -> dict:
    """`ember bench --rates` against the cluster: long prompts, long answers, open-loop."""
    out = Path(os.environ.get("OUT") or "benchmarks/results")
    stem = "pd_gpu_sweep-" + name.split(" ")[0]
    with cluster(model, engines, args.port) as urls:
        cmd = [
            sys.executable, "-m", "ember.cli", "bench", "--url", urls[0], "--workload", "random",
            "--num-requests", str(args.sweep_requests), "--input-len", "3072:5120",
            "--output-len", "256", "--rates", args.sweep, "--out", str(out), "--name", stem,
            "--no-progress",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, timeout=900)
    return json.loads((out / f"{stem}.json").read_text())


def run(name: str, model: str, engines: list[tuple[str, int]], args: argparse.Namespace) -> dict:
    with cluster(model, engines, args.port) as urls:
        agent = TokenAgent(args.sessions, args.turns)
        records, wall = asyncio.run(run_sessions(urls[0], agent, RunLimits(progress=False)))
        loads = {
            u: httpx.get(f"{u}/load", headers=internal_headers(SECRET)).json() for u in urls[1:]
        }
    summary = summarize(records, wall)
    decode = [ld for ld in loads.values() if ld.get("role") == "decode"]
    if decode and decode[0]["remote_kv_loads"]:
        d = decode[0]
        per_load = d["remote_kv_seconds"] / d["remote_kv_loads"]
        summary["kv_loads"] = d["remote_kv_loads"]
        summary["kv_load_failures"] = d["remote_kv_failures"]
        summary["kv_transfer_gb_s"] = d["remote_kv_bytes"] / max(d["remote_kv_seconds"], 1e-9) / 1e9
        summary["kv_transfer_ms_mean"] = per_load * 1e3
        summary["kv_transfer_share_of_ttft"] = per_load * 1e3 / summary["ttft_ms"]["mean"]
    records_out = [dataclasses.asdict(r) for r in records]
    return {"config": name, "summary": summary, "loads": loads, "records": records_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--port", type=int, default=18200)
    ap.add_argument("--sweep", default=None, help="rates for an `ember bench` sweep, e.g. 2,4,8")
    ap.add_argument("--sweep-requests", type=int, default=60)
    args = ap.parse_args()
    import torch

    gpu = torch.cuda.get_device_name(0)
    model = model_dir()
    if args.sweep:
        from ember.bench.report import plot_sweep, sweep_table

        configs = {
            "colocated": [("both", 0), ("both", 1)],
            "disaggregated": [("prefill", 0), ("decode", 1)],
        }
        sweeps = {n: sweep(n, model, e, args)["sweep"] for n, e in configs.items()}
        for n, sw in sweeps.items():
            print(f"\n## {n} ({gpu} x2)\n{sweep_table(sw)}")
        out = Path(os.environ.get("OUT") or "benchmarks/results")
        plot_sweep(sweeps, out / f"pd_gpu_sweep-{gpu.replace(' ', '_')}.png")
        return
    results = [
        run("colocated (2 x both)", model, [("both", 0), ("both", 1)], args),
        run("disaggregated (prefill GPU0 + decode GPU1)", model, [("prefill", 0), ("decode", 1)], args),
    ]  # fmt: skip
    print(f"\n{gpu} x2; {args.sessions} sessions x {args.turns} turns, 8B shape")
    print(compare_table(*results, names=("colocated", "disaggregated")))
    for r in results:
        s = r["summary"]
        if "kv_transfer_gb_s" in s:
            print(
                f"KV transfer ({r['config']}): {s['kv_loads']} loads "
                f"({s['kv_load_failures']} failed), {s['kv_transfer_gb_s']:.1f} GB/s, "
                f"{s['kv_transfer_ms_mean']:.1f} ms each, "
                f"{s['kv_transfer_share_of_ttft']:.1%} of mean TTFT"
            )
    out = result_path("pd_gpu", "2x" + hardware_label(gpu))
    out.write_text(json.dumps({"gpu": gpu, "args": vars(args), "results": results}, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
