"""Offline generation speed of the tiny model on the CPU, and where each step's time goes.

Prints a table and writes
benchmarks/results/offline_cpu-cpu-<date>.json (or `--out DIR`). Measures output tokens/s at batch 1 and 32
and the share of wall time spent outside the model's forward pass (scheduling, input preparation,
sampling, detokenizing, bookkeeping).

    .venv/bin/python benchmarks/offline_cpu.py [--arch qwen3] [--out-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from result_names import result_path

from ember import LLM, SamplingParams
from ember.models.tiny import ensure_tiny


class Timer:
    """Accumulates the wall time spent inside wrapped callables."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._undo: list[tuple[object, str, object, bool]] = []

    def wrap(self, obj: object, attr: str, label: str) -> None:
        fn = getattr(obj, attr)
        self._undo.append((obj, attr, fn, attr in vars(obj)))

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0

        setattr(obj, attr, timed)

    def restore(self) -> None:
        for obj, attr, fn, own in reversed(self._undo):
            if own:
                setattr(obj, attr, fn)
            else:
                delattr(obj, attr)


def run(llm: LLM, batch: int, prompt_len: int, out_tokens: int) -> dict[str, float]:
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=1.0, max_tokens=out_tokens, ignore_eos=True, seed=None)
    llm.engine.core.kv.pool.reset_prefix_cache()
    timer = Timer()
    runner = llm.engine.core.runner
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "forward")
    timer.wrap(runner, "sampler", "sampling")
    timer.wrap(runner, "prepare", "prepare_inputs")
    timer.wrap(llm.engine.core.scheduler, "schedule", "schedule")
    timer.wrap(llm.engine.processor, "process", "detokenize")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    timer.restore()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == batch * out_tokens
    fwd = timer.seconds.get("forward", 0.0)
    row = {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tok_s": generated / wall,
        "forward_s": fwd,
        "outside_forward_share": 1 - fwd / wall,
    }
    for k, v in timer.seconds.items():
        if k != "forward":
            row[f"{k}_share"] = v / wall
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    llm = LLM(str(ensure_tiny(args.arch)), dtype="float32", max_model_len=1024)
    run(llm, 1, args.prompt_tokens, 8)  # warm-up
    rows = [run(llm, int(b), args.prompt_tokens, args.out_tokens) for b in args.batches.split(",")]
    cols = [
        "batch",
        "output_tok_s",
        "outside_forward_share",
        "schedule_share",
        "prepare_inputs_share",
        "sampling_share",
        "detokenize_share",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print(
            "| "
            + " | ".join(
                f"{r.get(c, 0):.3f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols
            )
            + " |"
        )
    machine = f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"
    result = {
        "benchmark": "offline_cpu",
        "machine": machine,
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "model": f"tiny-{args.arch}",
        "rows": rows,
    }
    out = result_path("offline_cpu", "cpu", out_dir=args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
