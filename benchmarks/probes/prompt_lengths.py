"""Time to first token of fresh prompts of lengths the engine has not met, one at a time, in
process on the Moonlight shape (MLA + MoE, dummy bf16 weights), after a warm-up of 128-token
prompts: whether a new prompt length pays a one-time cost (a kernel plan, a compile) that a
length met before does not. An agent's every turn is a new length.

`--cudnn off` turns torch's cuDNN attention off for the whole process (what the expanded MLA
prefill's NO_CUDNN does for its own call), to compare.

    python benchmarks/probes/prompt_lengths.py [--cudnn on|off]

Prints the lengths and times and writes prompt_lengths-<GPU>-<date>[-cudnn-off].json to $OUT
(or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_turn import first_token_s  # noqa: E402
from engine_gpu import engine_config, random_prompts, shape_dir  # noqa: E402
from result_names import result_path  # noqa: E402

LENGTHS = (128, 100, 117, 133, 150, 128, 1000, 1003, 1000, 3000, 3001, 8000, 8001, 8000)
"""In this order: new lengths, and some met again (128, 1000, 8000)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cudnn", default="on", choices=["on", "off"])
    ap.add_argument("--tag", default="", help="what else sets this run apart (its file's name)")
    args = ap.parse_args()
    if args.cudnn == "off":
        torch.backends.cuda.enable_cudnn_sdp(False)
    from ember.engine.core import EngineCore

    core = EngineCore(engine_config(shape_dir("moonlight"), max_model_len=16384))
    vocab = core.model_config.vocab_size
    try:
        for i, p in enumerate(random_prompts(3, 128, vocab, 7)):
            first_token_s(core, f"warm{i}", p)
        times = []
        for n in LENGTHS:
            prompt = random_prompts(1, n, vocab, n * 7 + len(times))[0]
            times.append([n, round(first_token_s(core, f"r{len(times)}", prompt) * 1e3, 1)])
    finally:
        core.close()
    gpu = torch.cuda.get_device_name(0)
    print(f"## fresh prompts alone, Moonlight shape, {gpu}, cuDNN attention {args.cudnn}")
    print("| prompt tokens | " + " | ".join(str(n) for n, _ in times) + " |")
    print("|---|" + "---|" * len(times))
    print("| TTFT (ms) | " + " | ".join(f"{t:.1f}" for _, t in times) + " |")
    hw = gpu.replace("NVIDIA ", "").replace(" ", "-")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parents[1] / "results")
    tag = "-".join(t for t in ("cudnn-off" if args.cudnn == "off" else "", args.tag) if t)
    out = result_path("prompt_lengths", hw, tag=tag, out_dir=out_dir)
    out.write_text(json.dumps({"gpu": gpu, "cudnn": args.cudnn, "ttft_ms": times}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
