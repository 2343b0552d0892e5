"""The offline `LLM` API with defaults against the engine core, on one GPU, same load, same run.

What a user who sets nothing gets: `LLM(model, device="cuda")` on the Llama-3.1-8B shape (dummy bf16
weights, max_model_len 4096), 256 x (1024 random prompt tokens, 256 out, temperature 1, ignore_eos),
against (a) the same with the old default token budget (8,192), and (b) the engine core driven
directly (benchmarks/engine_gpu.py's `Run`, no detokenization) with the same resolved settings.
Each configuration runs in a process of its own: a cold run (Triton compiles on first use), then a
warm one. The `LLM` runs also time the host's output processing (detokenization, outputs).
Prints a table; writes
benchmarks/results/llm_gpu-<GPU>-<date>.json (or $OUT/ when set).

    python benchmarks/llm_gpu.py [--quick] [--fresh-triton-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gpu import SHAPES, Run, random_prompts, shape_dir  # noqa: E402
from benchmarks.result_names import result_path  # noqa: E402
from ember.engine.config import EngineConfig  # noqa: E402
from ember.engine.core import EngineCore  # noqa: E402
from ember.entrypoints.llm import LLM  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402

CONFIGS = ("llm_default", "llm_budget_8192", "engine_core")


def sizes(quick: bool) -> tuple[int, int, int]:
    return (32, 1024, 32) if quick else (256, 1024, 256)


def add_tokenizer(model: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with the shape's vocabulary size (no merges: the prompts are token
    ids), so the `LLM` detokenizes every output token as it would with the real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for i in range(len(vocab), vocab_size):
        vocab[f"\u0120w{i}"] = i  # "\u0120" is byte-level BPE's space: " w123" once decoded
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(model / "tokenizer.json"))


def run_llm(budget: int | None, quick: bool) -> dict[str, object]:
    model = shape_dir("llama")
    add_tokenizer(model, SHAPES["llama"]["vocab_size"])
    kw: dict[str, object] = dict(
        device="cuda", load_format="dummy", dtype="bfloat16", max_model_len=4096
    )
    if budget is not None:
        kw["max_num_batched_tokens"] = budget
    t0 = time.perf_counter()
    llm = LLM(str(model), **kw)
    torch.cuda.synchronize()
    startup = time.perf_counter() - t0
    proc = llm.engine.processor
    inner = proc.process
    spent = [0.0]

    def timed(*a: object, **k: object):  # noqa: ANN202 - wraps OutputProcessor.process
        s = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent[0] += time.perf_counter() - s

    proc.process = timed  # type: ignore[method-assign]
    n, plen, out_len = sizes(quick)
    params = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=True)
    runs = []
    for rep in range(2):
        prompts = random_prompts(n, plen, SHAPES["llama"]["vocab_size"], 13 + rep)
        spent[0] = 0.0
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.perf_counter() - t
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append(
            {
                "wall_s": wall,
                "output_tok_s": generated / wall,
                "host_output_processing_s": spent[0],
            }
        )
    return {
        "startup_s": startup,
        "token_budget": llm.engine.core.resolved.max_num_batched_tokens,
        "cold": runs[0],
        "warm": runs[1],
    }


def run_core(quick: bool) -> dict[str, object]:
    model = shape_dir("llama")
    cfg = EngineConfig(
        model=str(model), device="cuda", load_format="dummy", dtype="bfloat16", max_model_len=4096
    )
    t0 = time.perf_counter()
    core = EngineCore(cfg)
    torch.cuda.synchronize()
    startup = time.perf_counter() - t0
    run = Run(core)
    n, plen, out_len = sizes(quick)
    runs = []
    for rep in range(2):
        res = run(random_prompts(n, plen, SHAPES["llama"]["vocab_size"], 13 + rep), out_len)
        runs.append({"wall_s": res["wall_s"], "output_tok_s": res["generated"] / res["wall_s"]})
    return {
        "startup_s": startup,
        "token_budget": core.resolved.max_num_batched_tokens,
        "cold": runs[0],
        "warm": runs[1],
    }


def child(name: str, quick: bool) -> dict[str, object]:
    if name == "llm_default":
        return run_llm(None, quick)
    if name == "llm_budget_8192":
        return run_llm(8192, quick)
    return run_core(quick)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    ap.add_argument(
        "--fresh-triton-cache",
        action="store_true",
        help="a new Triton cache per configuration (without it, later ones find kernels compiled)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, args.quick)))
        return
    gpu = torch.cuda.get_device_name()
    results: dict[str, object] = {"gpu": gpu, "torch": torch.__version__, "configs": {}}
    for name in CONFIGS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--child", name, "--child-out", f.name]
            cmd += ["--quick"] if args.quick else []
            env = dict(os.environ)
            if args.fresh_triton_cache:
                # Each configuration compiles its kernels itself, so the cold runs compare.
                env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{name}-")
            subprocess.run(cmd, check=True, env=env)
            results["configs"][name] = json.loads(Path(f.name).read_text())  # type: ignore[index]
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    results["fresh_triton_cache"] = args.fresh_triton_cache
    suffix = "-fresh-triton-cache" if args.fresh_triton_cache else ""
    result_path("llm_gpu", gpu, tag=suffix, out_dir=out_dir).write_text(
        json.dumps(results, indent=2)
    )
    cfgs: dict[str, dict] = results["configs"]  # type: ignore[assignment]
    core_warm = cfgs["engine_core"]["warm"]["output_tok_s"]
    print(f"GPU: {gpu}; load {sizes(args.quick)} (prompts, in, out)")
    print("| path | budget | start s | cold tok/s | warm tok/s | warm / core | host out-proc s |")
    print("|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        r = cfgs[name]
        host = r["warm"].get("host_output_processing_s")
        print(
            f"| {name} | {r['token_budget']} | {r['startup_s']:.1f} | "
            f"{r['cold']['output_tok_s']:.0f} | {r['warm']['output_tok_s']:.0f} | "
            f"{r['warm']['output_tok_s'] / core_warm:.3f} | "
            f"{'' if host is None else f'{host:.2f}'} |"
        )


if __name__ == "__main__":
    main()
