"""The API process's per-token cost of turning the engine core's tokens into outputs: the
OutputProcessor (incremental detokenizing, stop strings, the RequestOutput each running request
gets every step) for N concurrent streams of M tokens each, one token a stream a step, on the
tiny model's tokenizer, on the CPU. `EMBER_TREE=DIR`: measure DIR's ember (an earlier commit's
tree) instead of this one's, for an A/B on one machine.

    .venv/bin/python benchmarks/output_processor.py [--streams 256] [--tokens 256] [--rounds 5]

Prints a table and writes
benchmarks/results/output_processor-cpu-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("EMBER_TREE") or str(Path(__file__).resolve().parents[1]))

from result_names import result_path  # noqa: E402

from ember.engine.messages import EngineCoreOutput  # noqa: E402
from ember.engine.output_processor import OutputProcessor, RequestState, SampleState  # noqa: E402
from ember.models.tiny import ensure_tiny  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402
from ember.tokenizer.detokenizer import IncrementalDetokenizer  # noqa: E402
from ember.tokenizer.tokenizer import Tokenizer  # noqa: E402


def one_round(tok: Tokenizer, streams: int, tokens: int, seed: int) -> float:
    """Microseconds of OutputProcessor.process per token."""
    rng = random.Random(seed)
    op = OutputProcessor(tok)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for r in range(streams):
        ids = [rng.randrange(10, 1000) for _ in range(30)]
        sample = SampleState(0, params, IncrementalDetokenizer(tok, ids, True))
        op.add_request(RequestState(f"r{r}", None, ids, {f"r{r}": sample}))
    spent = 0.0
    for step in range(tokens):
        last = "length" if step == tokens - 1 else None
        outs = [
            EngineCoreOutput(f"r{r}", [rng.randrange(10, 1000)], finish_reason=last)
            for r in range(streams)
        ]
        t0 = time.perf_counter()
        results, _ = op.process(outs)
        spent += time.perf_counter() - t0
        assert len(results) == streams
    return spent / (streams * tokens) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer.from_dir(str(ensure_tiny("llama")))
    us = [one_round(tok, args.streams, args.tokens, seed) for seed in range(args.rounds)]
    out = {
        "machine": f"{platform.machine()}-{os.cpu_count()}cores",
        "tree": os.environ.get("EMBER_TREE") or "working tree",
        "streams": args.streams,
        "tokens": args.tokens,
        "us_per_token": us,
        "median_us_per_token": statistics.median(us),
    }
    print("| streams x tokens | tree | OutputProcessor us per token (median of rounds) |")
    print("|---|---|---|")
    print(f"| {args.streams} x {args.tokens} | {out['tree']} | {out['median_us_per_token']:.2f} |")
    dest = Path(os.environ.get("OUT") or "benchmarks/results")
    path = result_path("output_processor", "cpu", out_dir=dest)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
