"""Reads the engine core's step log (`EMBER_DEBUG=ember.engine.steps`, ember/engine/core.py) and
tells, for each burst of requests in it, where its first second went and how its two phases ran:

- arrivals: when the API process submitted the burst's requests (its clock at each send, relative
  to the first) and when a step first saw them: a burst that reaches the core late or in one lump
  leaves the GPU on small steps meanwhile;
- phases: the first step of >= 8,192 tokens (the engine's first full prefill step), the prefill
  phase (every step that still prefills or has requests waiting), the decode phase after it (its
  steps and median gap), and the burst's whole span from its first step.

A burst starts at a step that saw arrivals after more than `--gap` seconds without one (the
in-process `benchmarks/probes/profile_mixed.py` adds each pass's requests at once: pass `--gap 0` there).
Prints a table and writes JSON beside the log (LOG.json).

    python benchmarks/step_log.py LOG [LOG ...] [--gap 1.0]

A tool, not a benchmark: writes each log's bursts as JSON beside the log.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

LINE = re.compile(
    r"step (\d+) at ([\d.]+): (\d+) rows \((\d+) prefilling\), (\d+) tokens; (\d+) waiting, "
    r"(\d+) arrived since(?: \(submitted ([\d.]+) to ([\d.]+)(?:, received ([\d.]+) to "
    r"([\d.]+))?\))?(?:; scheduled and launched in ([\d.]+) ms)?"
)
"""A step log's line (older logs have neither the receive times nor the host's
milliseconds to schedule and launch the step: both optional)."""
FULL_STEP_TOKENS = 8192


@dataclass(frozen=True)
class Step:
    index: int
    at: float
    rows: int
    prefilling: int
    tokens: int
    waiting: int
    arrived: int
    submitted: tuple[float, float] | None
    received: tuple[float, float] | None
    launch_ms: float | None


def parse(text: str) -> list[Step]:
    steps = []
    for m in map(LINE.search, text.splitlines()):
        if m is None:
            continue
        sub = (float(m[8]), float(m[9])) if m[8] else None
        got = (float(m[10]), float(m[11])) if m[10] else None
        launch = float(m[12]) if m[12] else None
        counts = (int(m[i]) for i in (3, 4, 5, 6, 7))
        steps.append(Step(int(m[1]), float(m[2]), *counts, sub, got, launch))
    return steps


def bursts(steps: list[Step], gap_s: float) -> list[list[Step]]:
    """The log cut where a step sees arrivals more than `gap_s` after the previous arrival."""
    out: list[list[Step]] = []
    last_arrival = None
    for s in steps:
        if s.arrived and (last_arrival is None or s.at - last_arrival > gap_s):
            out.append([])
        if s.arrived:
            last_arrival = s.at
        if out:
            out[-1].append(s)
    return out


def summarize(burst: list[Step]) -> dict:
    first = burst[0]
    t0 = first.submitted[0] if first.submitted else first.at
    arrivals = [
        {
            "requests": s.arrived,
            "submitted_ms": [round((x - t0) * 1e3, 1) for x in s.submitted]
            if s.submitted
            else None,
            "received_ms": [round((x - t0) * 1e3, 1) for x in s.received] if s.received else None,
            "seen_ms": round((s.at - t0) * 1e3, 1),
            "launch_ms": s.launch_ms,
        }
        for s in burst
        if s.arrived
    ]
    out: dict = {"requests": sum(s.arrived for s in burst), "arrivals": arrivals}
    full = next((i for i, s in enumerate(burst) if s.tokens >= FULL_STEP_TOKENS), None)
    busy = [i for i, s in enumerate(burst) if s.prefilling or s.waiting]
    if full is None or not busy or busy[-1] + 1 >= len(burst):
        return out  # no full step, or a log cut short: no phases
    decode = burst[busy[-1] + 1 :]
    gaps = sorted(b.at - a.at for a, b in zip(decode, decode[1:], strict=False))
    out |= {
        "first_full_step_ms": round((burst[full].at - t0) * 1e3, 1),
        "prefill_steps": busy[-1] + 1 - full,
        "prefill_s": round(decode[0].at - burst[full].at, 3),
        "decode_steps": len(decode),
        "decode_s": round(decode[-1].at - decode[0].at, 3),
        "decode_gap_ms_p50": round(gaps[len(gaps) // 2] * 1e3, 2) if gaps else None,
        "span_s": round(burst[-1].at - t0, 3),
    }
    return out


def arrival(a: dict) -> str:
    """One step's arrivals: submitted (the API process), received (the core), seen (the step's
    launch done), and the host's milliseconds to schedule and launch that step."""
    if not a["submitted_ms"]:
        return f"{a['requests']} seen at {a['seen_ms']:.1f} ms"
    sub, got = a["submitted_ms"], a["received_ms"]
    text = f"{a['requests']} submitted {sub[0]:.1f}-{sub[1]:.1f}"
    if got:
        text += f", received {got[0]:.1f}-{got[1]:.1f}"
    text += f", seen at {a['seen_ms']:.1f} ms"
    return text + (f" (launch {a['launch_ms']:.2f} ms)" if a["launch_ms"] is not None else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument(
        "--gap", type=float, default=1.0, help="seconds without arrivals between bursts"
    )
    args = ap.parse_args()
    for log in args.logs:
        found = [summarize(b) for b in bursts(parse(log.read_text()), args.gap)]
        print(f"\n## {log}\n")
        print("| burst | requests | first full step | prefill | decode | span |")
        print("|---|---|---|---|---|---|")
        for i, b in enumerate(found):
            if "span_s" not in b:
                print(f"| {i} | {b['requests']} | - | - | - | - |")
                continue
            print(
                f"| {i} | {b['requests']} | +{b['first_full_step_ms']:.0f} ms | "
                f"{b['prefill_steps']} steps, {b['prefill_s']:.2f} s | {b['decode_steps']} steps, "
                f"{b['decode_s']:.2f} s ({b['decode_gap_ms_p50']} ms) | {b['span_s']:.2f} s |"
            )
        for i, b in enumerate(found):
            print(f"burst {i} arrivals: " + "; ".join(map(arrival, b["arrivals"][:6])))
        out = log.with_suffix(".json")
        out.write_text(json.dumps({"log": str(log), "bursts": found}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
