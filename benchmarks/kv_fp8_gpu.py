"""An FP8 KV cache (`--kv-cache-dtype fp8`) against the model's dtype (bf16) on one GPU: what it
changes in the answers, how many more tokens fit, and what decoding over long contexts gains.

- **quality** (SmolLM2-135M-Instruct, `--model`, bf16 weights): 64 chat prompts
  (benchmarks/data/spec_chat.jsonl, the chat template applied), 64 greedy tokens each, with a
  bf16 cache and with an FP8 one. Counted: answers identical token for token; answers that part
  only at a near tie (where they part, the FP8 run's token is within TIE_GAP nats of the bf16
  run's best, in the bf16 run's own logprobs: the two caches differ by FP8's rounding, a few
  percent of each element, which moves a near tie either way); and tokens before the first
  difference. A control measures the same against the bf16 run: float16 weights and cache, a
  16-bit rounding of its own, how often answers part from rounding alone.
- **capacity** (Llama-3.1-8B and Moonlight-16B-A3B shapes, dummy bf16 weights, the same
  `gpu_memory_utilization`): the KV tokens the pool holds and the tokens a GB of it holds.
- **decode** (the same shapes): the median decode step of `--batch` requests over `--context`
  tokens each, with either cache; attention reads half the bytes from an FP8 one.

Each engine runs in a process of its own (the whole GPU for its KV sizing).

    python benchmarks/kv_fp8_gpu.py --model DIR [--parts quality,capacity] [--shapes llama,moonlight]

Prints tables and writes kv_fp8-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import Run, decode_steps, engine_config, random_prompts, shape_dir  # noqa: E402
from result_names import result_path  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
TIE_GAP = 0.5
"""Nats: where an FP8 run's answer parts from the bf16 run's at a token whose bf16 logprob is
within this of the best, a near tie decided by rounding (bf16's own logprob step at these values
is 1/8 to 1/4), not a wrong read."""
KV_DTYPES = ("auto", "fp8")


def quality(model: str, kv: str, max_tokens: int, device: str, dtype: str = "bfloat16") -> dict:
    from ember import LLM, SamplingParams

    prompts = [json.loads(line)["prompt"] for line in (DATA / "spec_chat.jsonl").open()][:64]
    llm = LLM(model, device=device, dtype=dtype, kv_cache_dtype=kv)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [
                [{str(t): v.logprob for t, v in step.items()} for step in o.outputs[0].logprobs]
                for o in outs
            ],
        }
    finally:
        llm.close()


def shape(name: str, kv: str, batch: int, context: int) -> dict:
    from ember.engine.core import EngineCore

    max_len = context + 128
    core = EngineCore(
        # (enough sequences that the pool is sized by memory, not by max_num_seqs x max_len)
        engine_config(shape_dir(name), kv_cache_dtype=kv, max_model_len=max_len, max_num_seqs=1024)
    )
    try:
        r = core.resolved
        tokens = core.num_kv_blocks * core.config.block_size
        kv_gb = core.num_kv_blocks * r.kv_block_bytes / 1e9
        vocab = core.model_config.vocab_size
        res = Run(core)(random_prompts(batch, context, vocab, 3), 64)
        steps = [s for s in decode_steps(res) if s[2] == batch]
        return {
            "kv_tokens": tokens,
            "kv_gb": round(kv_gb, 2),
            "tokens_per_gb": round(tokens / kv_gb),
            "decode_step_ms": round(statistics.median(s[0] for s in steps) * 1e3, 3),
            "decode_steps": len(steps),
        }
    finally:
        core.close()


def child(task: str, args: argparse.Namespace) -> dict:
    part, *rest = task.split(":")
    if part == "quality":
        dtype = "float16" if rest[0] == "fp16" else "bfloat16"
        return quality(
            args.model,
            "auto" if rest[0] == "fp16" else rest[0],
            args.max_tokens,
            args.device,
            dtype,
        )
    return shape(rest[0], rest[1], args.batch, args.context)


def run_child(task: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", task, "--child-out", f.name]
        cmd += ["--model", args.model or "", "--max-tokens", str(args.max_tokens)]
        cmd += ["--batch", str(args.batch), "--context", str(args.context)]
        cmd += ["--device", args.device]
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())


def compare(base: dict, fp8: dict) -> dict:
    """Identical answers, answers parted only at a near tie, and where the others part."""
    same = tie = 0
    parted = []
    kept = total = 0
    for a, b, lps in zip(base["tokens"], fp8["tokens"], base["logprobs"], strict=True):
        total += len(a)
        j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if j is None:
            same += 1
            kept += len(a)
            continue
        kept += j
        scored = lps[j]
        behind = max(scored.values()) - scored[str(b[j])] if str(b[j]) in scored else None
        near = behind is not None and behind <= TIE_GAP
        tie += near
        parted.append({"position": j, "behind_best": behind, "near_tie": near})
    n = len(base["tokens"])
    return {
        "answers": n,
        "identical": same,
        "parted_at_near_tie": tie,
        "identical_or_near_tie_share": round((same + tie) / n, 3),
        "tokens_before_first_difference_share": round(kept / total, 3),
        "parted": parted,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="SmolLM2's directory or GGUF (quality)")
    ap.add_argument("--parts", default="quality,capacity")
    ap.add_argument("--shapes", default="llama,moonlight")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu: the quality part alone, to check it")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, args)))
        return
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    parts = args.parts.split(",")
    result: dict = {"gpu": gpu, "tie_gap": TIE_GAP}
    if "quality" in parts:
        runs = {kv: run_child(f"quality:{kv}", args) for kv in (*KV_DTYPES, "fp16")}
        result["quality"] = compare(runs["auto"], runs["fp8"])
        result["control_fp16"] = compare(runs["auto"], runs["fp16"])
        q, c = result["quality"], result["control_fp16"]
        print(f"## FP8 KV against bf16 KV, SmolLM2-135M-Instruct bf16, {gpu}")
        print(
            f"{q['answers']} answers x {args.max_tokens} greedy tokens: {q['identical']} identical, "
            f"{q['parted_at_near_tie']} parted at a near tie (<= {TIE_GAP} nats), "
            f"{q['tokens_before_first_difference_share']:.0%} of tokens before any difference"
        )
        print(
            f"control, float16 weights and cache: {c['identical']} identical, "
            f"{c['parted_at_near_tie']} parted at a near tie, "
            f"{c['tokens_before_first_difference_share']:.0%} of tokens before any difference"
        )
    if "capacity" in parts:
        rows = {}
        for name in args.shapes.split(","):
            rows[name] = {kv: run_child(f"shape:{name}:{kv}", args) for kv in KV_DTYPES}
        result["shapes"] = rows
        result["decode"] = {"batch": args.batch, "context": args.context}
        print(f"## KV capacity and decode, batch {args.batch} x {args.context} tokens, {gpu}")
        print("| shape | KV | tokens | GB | tokens/GB | decode step ms |")
        print("|---|---|---|---|---|---|")
        for name, by_kv in rows.items():
            for kv, r in by_kv.items():
                print(
                    f"| {name} | {kv} | {r['kv_tokens']} | {r['kv_gb']} | {r['tokens_per_gb']} "
                    f"| {r['decode_step_ms']} |"
                )
    path = result_path("kv_fp8", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
