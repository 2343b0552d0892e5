"""An agent's next turn over its cached conversation: the time to the first token of a turn that
adds `--new` tokens to a context of C tokens already in the prefix cache (the prefill is an
extend: the new chunk's attention reads the whole cached context through the paged KV cache),
for KV pages of each `--block-sizes` size. In process (EngineCore, the engine's defaults, the
Llama-3.1-8B shape with dummy weights); each block size in its own process, one after the other.

For each context C: the conversation's first turn (C fresh tokens, chunked by the step budget),
then `--turns` next turns, each C + `--new` tokens whose first C are the cached ones (a different
new chunk each turn, so only the conversation is a cache hit); the median next turn's time to
its first token is the number. Prints a table and writes
benchmarks/results/agent_turn-<GPU>-<date>.json (or $OUT/ when set).

    python benchmarks/agent_turn.py [--contexts 8192,16384,32768] [--new 1024] [--block-sizes 16,64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from result_names import result_path  # noqa: E402


def first_token_s(core, request_id: str, prompt: list[int]) -> float:
    """Seconds from submitting `prompt` (one output token) to its first output, stepping the core."""
    from ember.engine.messages import EngineCoreRequest
    from ember.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    core.add_request(EngineCoreRequest(request_id, prompt, params, [], max_tokens=1))
    while True:
        if any(o.request_id == request_id for o in core.step()):
            return time.perf_counter() - t0


def one_block_size(block_size: int, contexts: list[int], new: int, turns: int) -> dict:
    """Time the turns on an engine with KV pages of `block_size` tokens."""
    import torch
    from engine_gpu import engine_config, random_prompts, shape_dir

    from ember.engine.core import EngineCore

    top = max(contexts) + (turns + 1) * new
    core = EngineCore(engine_config(shape_dir("llama"), block_size=block_size, max_model_len=top))
    vocab = core.model_config.vocab_size
    first_token_s(core, "warm", random_prompts(1, 2 * new, vocab, 99)[0])
    rows = {}
    for c in contexts:
        conv = random_prompts(1, c, vocab, c)[0]
        first = first_token_s(core, f"c{c}-first", conv)
        nexts = []
        for t in range(turns):
            chunk = random_prompts(1, new, vocab, 1000 * c + t)[0]
            nexts.append(first_token_s(core, f"c{c}-turn{t}", conv + chunk))
        rows[str(c)] = {"first_turn_s": first, "next_turn_s": statistics.median(nexts)}
        print(f"block {block_size}, context {c}: first turn {first * 1e3:.1f} ms, next turns "
              f"{', '.join(f'{x * 1e3:.1f}' for x in nexts)} ms", flush=True)  # fmt: skip
    return {"gpu": torch.cuda.get_device_name(), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--block-sizes", default="16,64")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's size
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.one is not None:
        doc = one_block_size(args.one, contexts, args.new, args.turns)
        Path(args.json).write_text(json.dumps(doc))
        return
    dest = Path(os.environ.get("OUT") or "benchmarks/results")
    report: dict = {"new_tokens": args.new, "turns": args.turns, "block_sizes": {}}
    for bs in [int(b) for b in args.block_sizes.split(",")]:
        part = dest / f"agent_turn-block{bs}.part.json"
        subprocess.run(
            [sys.executable, __file__, "--one", str(bs), "--json", str(part),
             "--contexts", args.contexts, "--new", str(args.new), "--turns", str(args.turns)],
            check=True,
        )  # fmt: skip
        doc = json.loads(part.read_text())
        part.unlink()
        report["gpu"] = doc["gpu"]
        report["block_sizes"][str(bs)] = doc["rows"]
    sizes = list(report["block_sizes"])
    print(f"\nGPU: {report['gpu']}; a next turn adds {args.new} tokens; ms to its first token")
    print("| context | " + " | ".join(f"pages of {b}: first / next turn" for b in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for c in contexts:
        cells = [report["block_sizes"][b][str(c)] for b in sizes]
        print(f"| {c} | " + " | ".join(
            f"{r['first_turn_s'] * 1e3:.1f} / {r['next_turn_s'] * 1e3:.1f}" for r in cells) + " |")  # fmt: skip
    out = result_path("agent_turn", report["gpu"], out_dir=dest)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
