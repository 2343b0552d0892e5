"""Reads the engine core's step log (`EMBER_DEBUG=ember.engine.steps`, ember/engine/core.py) and
tells, for each burst of requests in it, where its first second went and how its two phases ran:

- arrivals: when the API process submitted the burst's requests (its clock at each send, relative
  to the first) and when a step first saw them: a burst that reaches the core late or in one lump
  leaves the GPU on small steps meanwhile;
- phases: the first step of >= 8,192 tokens (the engine's first full prefill step), the prefill
  phase (every step that still prefills or has requests waiting), the decode phase after it (its
  steps and median gap), and the burst's whole span from its first step.

A burst starts at a step that saw arrivals after more than `--gap` seconds without one (the
in-process `benchmarks/profile_mixed.py` adds each pass's requests at once: pass `--gap 0` there).
Prints a table and writes JSON beside the log (LOG.json).

    python benchmarks/step_log.py LOG [LOG ...] [--gap 1.0]
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

LINE = re.compile(
    r"step (\d+) at ([\d.]+): (\d+) rows \((\d+) prefilling\), (\d+) tokens; (\d+) waiting, "
    r"(\d+) arrived since(?: \(submitted ([\d.]+) to ([\d.]+)\))?"
)
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


def parse(text: str) -> list[Step]:
    steps = []
    for m in map(LINE.search, text.splitlines()):
        if m is None:
            continue
        sub = (float(m[8]), float(m[9])) if m[8] else None
        steps.append(
            Step(int(m[1]), float(m[2]), int(m[3]), int(m[4]), int(m[5]), int(m[6]), int(m[7]), sub)
        )
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
            "seen_ms": round((s.at - t0) * 1e3, 1),
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
            lumps = [
                f"{a['requests']} submitted {a['submitted_ms'][0]:.0f}-{a['submitted_ms'][1]:.0f} "
                f"ms, seen at {a['seen_ms']:.0f}"
                for a in b["arrivals"][:6]
                if a["submitted_ms"]
            ]
            print(f"burst {i} arrivals: " + "; ".join(lumps))
        out = log.with_suffix(".json")
        out.write_text(json.dumps({"log": str(log), "bursts": found}, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
