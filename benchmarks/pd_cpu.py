"""Colocated against disaggregated serving of the tiny model on the CPU, under a small agentic load.

Two clusters of two engines each behind `ember router`, started one after the other with
`ember up`'s own code: two colocated engines (`--both 2`), then one prefill and one decode engine.
The load: S sessions at once, each T turns; every turn resends the shared system prompt, the
session's history and a new tool result, streamed, greedy, `x-session-affinity` set. Reports TTFT,
ITL (p50/p90), output tokens/s and the prompt-cache hit ratio, prints a table, writes JSON.

    python benchmarks/pd_cpu.py [--sessions 8 --turns 3]

On a 2-core machine the engines share the cores with each other and with the client, so this
measures the machinery's overheads (the extra leg, the KV read), not the interference that
disaggregation removes on GPUs.

Writes benchmarks/results/pd_cpu-cpu-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_names import result_path  # noqa: E402
from ember.bench.compare import compare_table  # noqa: E402
from ember.bench.metrics import summarize  # noqa: E402
from ember.bench.records import PlannedRequest  # noqa: E402
from ember.bench.runner import RunLimits, run_sessions  # noqa: E402
from ember.cluster import start_cluster, stop_cluster, wait_healthy, wait_routed  # noqa: E402
from ember.models.tiny import ensure_tiny  # noqa: E402
from ember.trust import new_secret  # noqa: E402

WORDS = ["agent", "tool", "call", "result", "file", "read", "write", "test", "patch", "diff"]


def text(seed: int, n: int) -> str:
    return " ".join(f"{WORDS[(seed + i * i) % len(WORDS)]}{i % 17}" for i in range(n))


SYSTEM = "You are a coding agent. Tools: read_file, write_file, run_tests. " + text(0, 250)


@dataclass(slots=True)
class CpuAgent:
    """The sessions `ember bench` drives (runner.SessionWorkload): a shared system prompt, then
    each turn the answer and a new tool result; sized for the tiny model on a CPU."""

    model: str
    sessions: int
    turns: int
    affinity: bool = True
    think_time_s: float = 0.0

    def session_start(self, session_idx: int) -> float:
        return 0.0

    def first(self, session_idx: int) -> PlannedRequest:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": text(session_idx, 60)},
        ]
        return self._request(session_idx, 0, messages)

    def next(self, prev: PlannedRequest, answer_text: str) -> PlannedRequest | None:
        sid, turn = int(prev.request_id.split("-")[0].removeprefix("ses_")), prev.turn + 1
        if turn >= self.turns:
            return None
        messages = [
            *prev.body["messages"],
            {"role": "assistant", "content": answer_text},
            {"role": "user", "content": "tool result: " + text(sid * 31 + prev.turn, 120)},
        ]
        return self._request(sid, turn, messages)

    def _request(self, sid: int, turn: int, messages: list[dict]) -> PlannedRequest:
        body = {"model": self.model, "messages": messages, "max_tokens": 32, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        return PlannedRequest(
            f"ses_{sid}-{turn}", "/v1/chat/completions", body, session=f"ses_{sid}", turn=turn
        )


def run_config(name: str, model: str, port: int, args: argparse.Namespace, **roles: int) -> dict:
    ns = argparse.Namespace(
        prefill=roles.get("prefill", 0), decode=roles.get("decode", 0), both=roles.get("both", 0),
        host="127.0.0.1", port=port, engine_port=None, device="cpu", max_model_len=4096,
        kv_transport="mooncake", disagg_min_uncached=256,
    )  # fmt: skip
    secret = new_secret()  # what ember up does: the router polls the engines' /load with it
    procs = start_cluster(ns, model, secret)
    try:
        wait_healthy(procs, 300)
        wait_routed(procs[-1].url, secret)
        agent = CpuAgent(model, args.sessions, args.turns)
        limits = RunLimits(progress=False)
        records, wall = asyncio.run(run_sessions(procs[-1].url, agent, limits))
    finally:
        stop_cluster(procs)
    return {
        "config": name,
        "summary": summarize(records, wall),
        "records": [dataclasses.asdict(r) for r in records],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--port", type=int, default=18100)
    args = ap.parse_args()
    model = str(ensure_tiny("llama"))
    results = [
        run_config("colocated (2 x both)", model, args.port, args, both=2),
        run_config("disaggregated (1 prefill + 1 decode)", model, args.port + 10, args, prefill=1, decode=1),
    ]  # fmt: skip
    cpu = f"cpu-{platform.machine()}-{os.cpu_count()}cores"
    print(f"\n{args.sessions} sessions x {args.turns} turns, tiny llama, {cpu}")
    print(compare_table(*results, names=("colocated", "disaggregated")))
    out = result_path("pd_cpu", "cpu")
    body = {"sessions": args.sessions, "turns": args.turns, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
