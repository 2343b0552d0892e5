"""Perplexity of SmolLM2-135M-Instruct on a fixed text, through ember and through transformers.

The text is benchmarks/data/stdlib_docstrings.txt (Python 3.11's standard-library docstrings, made
once by scripts/make_quality_text.py), tokenized once and cut into non-overlapping windows of
`--window` tokens. Each window is scored by ember (`LLM.generate` with `prompt_logprobs=0` and
`max_tokens=1`: the logprob of every token after the window's first) and by transformers'
`AutoModelForCausalLM` on the same ids; perplexity is exp(-mean logprob) over every scored token.

ember and transformers in float32 must agree within 0.1% (the script exits 1 otherwise). With
`--dtype bfloat16` the same run also scores ember and transformers in float32, so the table shows the
drift bfloat16 costs against float32. Prints a table; writes JSON to `--out PATH`, by default to a new, dated file,
benchmarks/results/quality-<GPU or cpu>-<date>-<dtype>.json (refused if that file exists: a
result already recorded is never replaced silently; name it with `--out` to replace it).

    .venv/bin/python benchmarks/quality.py                    # CPU, float32, a few windows
    python benchmarks/quality.py --device cuda --dtype bfloat16 --max-windows 0   # every window
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_names import RESULTS, result_path  # noqa: E402
from ember import LLM, SamplingParams  # noqa: E402
from ember.models.resolve import get_model  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "stdlib_docstrings.txt"
TOLERANCE = 1e-3
"""ember against transformers, both in float32: relative perplexity difference at most 0.1%."""


@dataclass(slots=True)
class Score:
    engine: str
    dtype: str
    device: str
    logprobs: list[float] = field(repr=False)
    """Per scored token, window after window."""
    wall_s: float

    @property
    def perplexity(self) -> float:
        return math.exp(-math.fsum(self.logprobs) / len(self.logprobs))

    def row(self, reference: Score) -> dict[str, object]:
        diffs = [abs(a - b) for a, b in zip(self.logprobs, reference.logprobs, strict=True)]
        return {
            "engine": self.engine,
            "dtype": self.dtype,
            "device": self.device,
            "perplexity": self.perplexity,
            "rel_diff": abs(self.perplexity - reference.perplexity) / reference.perplexity,
            "max_abs_logprob_diff": max(diffs),
            "tokens_scored": len(self.logprobs),
            "wall_s": self.wall_s,
            "tokens_per_s": len(self.logprobs) / self.wall_s,
        }


def windows(model_dir: Path, size: int, max_windows: int) -> list[list[int]]:
    """The text's token ids in full, non-overlapping windows (0: every window)."""
    from transformers import AutoTokenizer

    # The whole text at once (past the model's context: it is cut into windows below).
    tokenizer = AutoTokenizer.from_pretrained(model_dir, model_max_length=sys.maxsize)
    ids = tokenizer(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    count = len(ids) // size
    if max_windows:
        count = min(count, max_windows)
    if count < 1:
        raise SystemExit(f"the text has {len(ids)} tokens: not one window of {size}")
    return [ids[i * size : (i + 1) * size] for i in range(count)]


def score_ember(model_dir: Path, batch: list[list[int]], dtype: str, device: str) -> Score:
    kw: dict[str, object] = {"dtype": dtype, "device": device, "max_model_len": len(batch[0]) + 1}
    if device.startswith("cuda"):
        kw["gpu_memory_utilization"] = 0.5  # transformers runs in the same process after it
    llm = LLM(str(model_dir), **kw)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    llm.generate(batch[0][:64], params)  # warm-up (CUDA graphs, Triton kernels)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    wall = time.perf_counter() - t0
    logprobs = []
    for ids, out in zip(batch, outs, strict=True):
        scored = out.prompt_logprobs
        if scored is None:
            raise RuntimeError("ember returned no prompt logprobs")
        logprobs += [step[tok].logprob for tok, step in zip(ids[1:], scored[1:], strict=True)]
    del llm
    _free(device)
    return Score("ember", dtype, device, logprobs, wall)


@torch.inference_mode()
def score_transformers(model_dir: Path, batch: list[list[int]], dtype: str, device: str) -> Score:
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    model(torch.tensor([batch[0][:64]], device=device))  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    logprobs: list[float] = []
    for ids in batch:  # one window at a time: a batch's float32 logits would not fit a small host
        x = torch.tensor([ids], device=device)
        lp = model(x).logits[0, :-1].float().log_softmax(-1)
        logprobs += lp.gather(1, x[0, 1:, None])[:, 0].tolist()
    wall = time.perf_counter() - t0
    del model
    _free(device)
    return Score("transformers", dtype, device, logprobs, wall)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def output_path(
    out: Path | None, hardware: str, dtype: str, *, results: Path = RESULTS, date: str | None = None
) -> Path:
    """Where the result goes: `out` when given (written even if it exists: the caller named it),
    else a new dated file in `results`; an existing one there is refused, never overwritten."""
    if out is not None:
        return out
    path = result_path("quality", hardware, tag=dtype, out_dir=results, date=date)
    if path.exists():
        raise SystemExit(f"{path} exists; pass --out PATH to write elsewhere (or to replace it)")
    return path


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="a Hugging Face directory (default: SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--max-windows", type=int, default=4, help="0: every window of the text")
    ap.add_argument(
        "--out", type=Path, help="the JSON path (default: a new dated file in benchmarks/results/)"
    )
    args = ap.parse_args()
    out = output_path(args.out, machine(args.device), args.dtype)
    model_dir = args.model or get_model("smollm2")
    batch = windows(model_dir, args.window, args.max_windows)

    dtypes = ["float32"] if args.dtype == "float32" else ["float32", args.dtype]
    scores = [score_ember(model_dir, batch, d, args.device) for d in dtypes]
    scores += [score_transformers(model_dir, batch, d, args.device) for d in dtypes]
    reference = next(s for s in scores if s.engine == "transformers" and s.dtype == "float32")
    rows = [s.row(reference) for s in scores]

    print(
        f"{model_dir.name}: {len(batch)} windows of {args.window} tokens, {TEXT.name}, "
        f"{args.device}; rel_diff against transformers float32"
    )
    cols = ["engine", "dtype", "perplexity", "rel_diff", "max_abs_logprob_diff", "tokens_scored",
            "wall_s", "tokens_per_s"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_cell(r[c]) for c in cols) + " |")

    ember32 = next(r for r in rows if r["engine"] == "ember" and r["dtype"] == "float32")
    agrees = float(ember32["rel_diff"]) <= TOLERANCE  # type: ignore[arg-type]
    result = {
        "benchmark": "quality",
        "machine": machine(args.device),
        "torch": torch.__version__,
        "model": model_dir.name,
        "text": TEXT.name,
        "window": args.window,
        "windows": len(batch),
        "float32_within_0.1pct": agrees,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if not agrees:
        raise SystemExit(
            f"ember float32 perplexity differs from transformers' by {ember32['rel_diff']:.2e} "
            f"(more than {TOLERANCE:.0e})"
        )


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3e}" if v < 0.01 else f"{v:.4f}"
    return str(v)


if __name__ == "__main__":
    main()
