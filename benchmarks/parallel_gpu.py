"""ember's tensor-parallel engine on several GPUs of one host: the same answers as one GPU, and
its speed beside vLLM at the same parallel size.

- correctness: greedy tokens and their logprobs of one GPU against N (`--tp`), in float32 and
  bf16, on weights written as files that every run reads (dummy weights differ by rank: each rank
  draws its own shard). The Llama-3.1-8B shape's files are served_gpu.write_weights' random bf16
  checkpoint (`--check-layers`, 4 by default); Moonlight's (MLA, 64 experts top-6) are
  ember.models.tiny.make_tiny's DeepSeek-V3 checkpoint at Moonlight's dims (float32, its
  3,072-token vocabulary), compared at EP=N against one GPU with `--enable-expert-parallel`.
  float32 must give identical tokens (logprobs within 1e-3). bf16 sums in another order, and
  on an MoE a rounding can flip an expert's choice and then the tokens, as it does between one
  device's bf16 and float32: so bf16 at N is judged by its distance to one device's float32
  answers (mean |logprob gap|, quantized_gpu.compare's measure), at most 1.5x one device's bf16
  distance + 0.02;
- speed: `ember serve --tensor-parallel-size N` (and `vllm serve --tensor-parallel-size N` with
  `--engines ember,vllm`), dummy weights, the same client (`ember bench`): start to ready (a
  fresh start with empty compile caches, then a warm one), decode at batch 1 (128 in, 512 out,
  three times: TPOT p50) against the copy roofline of one rank (the bytes a rank reads a step,
  over the per-GPU copy bandwidth measured in the run on every GPU, before and after; the
  higher is used), and the mixed load (256 x (1,024 in, 256 out), all at once: output tok/s),
  both loads on the last start.

A rank reads its slice of every split weight (heads, MLP widths, the vocabulary, the experts
a step hits: under expert parallelism the mean rank's share, so the busiest rank reads more)
and the whole of what every rank keeps: the norms, the router, MLA's latent projections, Llama
KV heads replicated past their count, and MLA's whole latent KV cache.

Shapes are served_gpu's (engine_gpu's and Kimi K2's) and `kimi_k25`: Kimi K2.5's text model (61
layers, the first dense, hidden 7168, MLA, 384 experts top-8 + 1 shared; the routed experts INT4
group 32, benchmarks/quant_schemes.py KIMI_K25_INT4), `--layers` to fit the GPUs; run it with
`--enable-expert-parallel`. Its correctness needs an INT4 checkpoint written as files at its
dims, which nothing here writes: that part is skipped with the reason.

`--device cpu`: a smoke run of this script on the CPU: a tiny Llama and a tiny DeepSeek-V3 over
2 gloo processes, a few requests; its figures mean nothing.

    python benchmarks/parallel_gpu.py [--shape llama] [--tp 2,4,8] [--engines ember,vllm]
        [--parts correctness,speed] [--enable-expert-parallel] [--layers N] [--check-layers N]
        [--enable-dp-attention] [--dtypes float32,bfloat16] [--starts fresh,warm]

Every check and every ceiling runs in a process of its own (the serving GPUs stay free; one that
fails is reported and the rest go on). Prints a table and writes
benchmarks/results/parallel_gpu-<N>x<GPU>-<date>-<shape>[-<layers>L][-ep].json (or $OUT/),
after each part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_schemes import KIMI_K25_INT4  # noqa: E402
from benchmarks.result_names import hardware_label, result_path  # noqa: E402
from benchmarks.served_gpu import (  # noqa: E402
    ALL_SHAPES,
    GPU_LOADS,
    Loads,
    command,
    environment,
    model_dir,
    run_loads,
    start,
    startup_lines,
    write_weights,
)
from ember.cluster import stop_processes  # noqa: E402
from ember.kv.tiers.store_master import free_port  # noqa: E402

KIMI_K25 = {
    **ALL_SHAPES["kimi_k2"],
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "quantization_config": KIMI_K25_INT4,
}
"""moonshotai/Kimi-K2.5's text model: Kimi K2's dims, its first layer dense, INT4 experts."""
SHAPES = {**ALL_SHAPES, "kimi_k25": KIMI_K25}

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""The CPU smoke run's dense model (its weights written by write_weights, as the 8B shape's)."""
CPU_LOADS = Loads((4, 16, 8), (1, 16, 8), "", "10:500")
CHECK = {"cuda": (16, 32, 32), "cpu": (8, 8, 8)}
"""(prompts, prompt tokens, greedy tokens) of a correctness check."""
FP32_LOGPROB_TOL = 1e-3
NOISE_FACTOR, NOISE_SLACK = 1.5, 0.02
"""A lower precision at N devices passes when its mean |logprob gap| to one device's float32
answers is at most NOISE_FACTOR x one device's in that precision, + NOISE_SLACK."""


# -- what a rank reads ----------------------------------------------------------------------------


def rank_step_bytes(
    cfg: dict, size: int, context: float, dp_attention: bool = False
) -> dict[str, float]:
    """Bytes one of `size` ranks reads in a decode step at batch 1 with `context` tokens of KV:
    its slice of every split weight, and the whole of what each rank keeps (see the docstring).
    At size 1 it is quantized_gpu.decode_bytes(cfg, 1, context). `dp_attention` (MLA): every
    rank holds all of attention's weights, and the request's rank reads its KV."""
    from benchmarks.engine_gpu import is_mla, kv_bytes_per_token, moe_dims
    from benchmarks.quantized_gpu import bytes_per_param, param_groups
    from ember.distributed.shard import shard_heads

    groups, per = param_groups(cfg), bytes_per_param(cfg)
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    kept = groups["norms"] * per["norms"] + groups["router"] * per["router"]
    attention = groups["attention"] * per["attention"]
    if is_mla(cfg):
        # kv_a_proj_with_mqa and q's LoRA (q_a_proj) are whole on every rank, as is the cache.
        latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + (cfg.get("q_lora_rank") or 0)
        kept += layers * h * latent * per["attention"]
        attention -= layers * h * latent * per["attention"]
        kv_token = kv_bytes_per_token(cfg)
    else:
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or h // heads
        rank_kv = shard_heads(heads, kv, 0, size).num_kv_heads
        kv_proj = layers * 2 * h * d * per["attention"]  # one KV head's k and v projections
        kept += rank_kv * kv_proj
        attention -= kv * kv_proj
        kv_token = layers * 2 * rank_kv * d * 2
    moe_layers, _, top_k = moe_dims(cfg)
    if dp_attention and is_mla(cfg):
        kept += attention + groups["kv_b"] * per["kv_b"]
        attention = 0
    else:
        attention += groups["kv_b"] * per["kv_b"]
    split = attention + sum(groups[g] * per[g] for g in ("dense_mlp", "shared_experts", "lm_head"))
    split += moe_layers * top_k * groups["expert"] * per["routed_experts"]
    weights = kept + split / size
    return {"weights": weights, "kv": context * kv_token, "total": weights + context * kv_token}


# -- the tasks each child process runs ------------------------------------------------------------


def copy_rates(device: str, gpus: int) -> dict[str, Any]:
    """Device-to-device copy bandwidth of each of the first `gpus` GPUs (engine_gpu's timer), or
    the host's copy rate for a CPU smoke run."""
    import torch

    if device == "cpu":
        x = torch.randn(1 << 24)
        y = torch.empty_like(x)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - t0)
        return {"gpu": "cpu", "copy_bytes_per_s": [2 * x.numel() * 4 / statistics.median(times)]}
    from benchmarks.engine_gpu import copy_bandwidth

    rates = []
    for i in range(gpus):
        torch.cuda.set_device(i)
        rates.append(copy_bandwidth())
        torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(0), "copy_bytes_per_s": rates}


def moe_overrides(cfg: dict) -> dict:
    """make_tiny's DeepSeek-V3 config at `cfg`'s dims (not its vocabulary: the tokenizer's)."""
    skip = ("vocab_size", "bos_token_id", "eos_token_id", "torch_dtype")
    out = {k: v for k, v in cfg.items() if k not in skip}
    out["head_dim"] = cfg["qk_rope_head_dim"]  # as make_tiny (and transformers) write it
    return out


def write_check_model(shape: str, layers: int, device: str) -> dict[str, Any]:
    """The correctness check's checkpoint as files in a new directory: a dense shape's random
    bf16 weights (made on `device`), or a DeepSeek-V3 shape's through make_tiny (on the CPU,
    float32; `tiny_moe`: make_tiny's own tiny DeepSeek-V3)."""
    from ember.models.tiny import make_tiny

    cfg = dict(TINY) if shape == "tiny" else {**SHAPES.get(shape, {}), "num_hidden_layers": layers}
    if shape == "tiny_moe" or cfg.get("model_type") == "deepseek_v3":
        d = Path(tempfile.mkdtemp(prefix=f"parallel-check-{shape}-"))
        make_tiny(d, "deepseek_v3", overrides=None if shape == "tiny_moe" else moe_overrides(cfg))
    else:
        d = model_dir(shape, cfg)
        write_weights(d, cfg, device)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    return {"model": str(d), "vocab_size": vocab}


def greedy(spec: dict[str, Any]) -> dict[str, Any]:
    """Each prompt's greedy tokens and their logprobs from `LLM` at the spec's parallel size."""
    from ember import LLM, SamplingParams

    llm = LLM(
        spec["model"],
        device=spec["device"],
        dtype=spec["dtype"],
        tensor_parallel_size=spec["tp"],
        enable_expert_parallel=spec["ep"],
        enable_dp_attention=spec.get("dp", False) and spec["tp"] > 1,
        max_model_len=256,
        max_num_seqs=len(spec["prompts"]),
        kv_host_gb=0,
        warmup=False,
    )
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=spec["new"], logprobs=1, ignore_eos=True
        )
        outs = llm.generate([list(p) for p in spec["prompts"]], params)
    finally:
        llm.close()
    runs = []
    for o in outs:
        toks = list(o.outputs[0].token_ids)
        chosen = [lp[t].logprob for t, lp in zip(toks, o.outputs[0].logprobs, strict=True)]
        runs.append([toks, chosen])
    return {"outputs": runs}


def child(task: str, spec: dict[str, Any]) -> dict[str, Any]:
    if task == "ceilings":
        return copy_rates(spec["device"], spec["gpus"])
    if task == "weights":
        return write_check_model(spec["shape"], spec["layers"], spec["device"])
    if task == "greedy":
        return greedy(spec)
    raise ValueError(f"unknown task {task!r}")


def run_child(task: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """`task` in a process of its own: its result, or {"error": the end of its log}."""
    name = f"{task}-{len(list(work.glob('*.log')))}"
    out, log = work / f"{name}.json", work / f"{name}.log"
    cmd = [sys.executable, __file__, "--child", task, "--child-spec", json.dumps(spec)]
    with log.open("w") as f:
        done = subprocess.run([*cmd, "--child-out", str(out)], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        return {"error": f"exited with {done.returncode}: " + " | ".join(tail), "log": str(log)}
    return json.loads(out.read_text())


# -- correctness ----------------------------------------------------------------------------------


CHECK_FILE_LIMIT = 48e9
"""The most bytes of float32 files a DeepSeek-V3 shape's check writes (make_tiny holds them all
in host memory before it writes them)."""


def check_skip(shape: str, cfg: dict, layers: int, device: str) -> str | None:
    """Why the shape's correctness check cannot run here, or None."""
    from benchmarks.engine_gpu import param_count

    if device == "cpu":
        return None
    if cfg.get("quantization_config"):
        return (
            f"{shape}: the check needs a quantized checkpoint written as files at these dims "
            "(packed INT4 or FP8 tensors, tens of GB a layer), which this script does not "
            "write; tests/engine/test_tensor_parallel.py checks Kimi K2.5's scheme at EP 2 "
            "on a tiny one, and `--shape moonlight` checks MLA and MoE at real dims"
        )
    if cfg.get("model_type") == "deepseek_v3":
        size = 4 * param_count({**cfg, "num_hidden_layers": layers})
        if size <= CHECK_FILE_LIMIT:
            return None
        return (
            f"{shape}: {layers} layers are {size / 1e9:.0f} GB of float32 files (at most "
            f"{CHECK_FILE_LIMIT / 1e9:.0f} GB are written); `--shape moonlight` checks MLA and "
            "expert parallelism at real dims"
        )
    if shape == "llama":
        return None
    return (
        f"{shape}: file weights are written for the llama shape (write_weights) and DeepSeek-V3 "
        "shapes (make_tiny) only"
    )


def judge(dtype: str, cmp: dict[str, Any], fp32_tol: float) -> bool:
    """float32: identical tokens, logprobs within `fp32_tol`. A lower precision: no further from
    one device's float32 answers than one device in that dtype is (see the docstring)."""
    if dtype == "float32":
        return cmp["identical_frac"] == 1.0 and cmp["max_abs_logprob_gap"] <= fp32_tol
    floor = cmp["one_vs_float32_gap"]
    return cmp["vs_float32_gap"] <= NOISE_FACTOR * floor + NOISE_SLACK


def correctness(
    shape: str, sizes: list[int], ep: bool, args: argparse.Namespace, work: Path, dp: bool = False
) -> dict[str, Any]:
    """One device against each parallel size (`ep`: whole experts a rank; `dp`: data-parallel
    attention), in each dtype, on the same files (removed after); one device in float32 is every
    dtype's reference too."""
    from benchmarks.engine_gpu import random_prompts
    from benchmarks.quantized_gpu import compare

    if reason := check_skip(shape, SHAPES.get(shape, TINY), args.check_layers, args.device):
        print(f"correctness skipped: {reason}")
        return {"skipped": reason}
    spec = {"shape": shape, "layers": args.check_layers, "device": args.device}
    written = run_child("weights", spec, work)
    if "error" in written:
        return written
    n, length, new = CHECK[args.device]
    prompts = random_prompts(n, length, written["vocab_size"], 5)
    base = {"model": written["model"], "device": args.device, "prompts": prompts, "new": new}
    tol = 1e-4 if args.device == "cpu" else FP32_LOGPROB_TOL
    layers = None if shape.startswith("tiny") else args.check_layers
    result: dict[str, Any] = {"layers": layers, "runs": {}}

    def greedy_at(dtype: str, size: int, ep: bool) -> dict[str, Any]:
        return run_child("greedy", {**base, "dtype": dtype, "tp": size, "ep": ep, "dp": dp}, work)

    try:
        truth = greedy_at("float32", 1, False)
        for dtype in args.dtypes.split(","):
            one = truth if dtype == "float32" else greedy_at(dtype, 1, False)
            for size in sizes:
                key = f"{dtype} {'dp-' if dp else ''}{'ep' if ep else 'tp'}{size}"
                got = greedy_at(dtype, size, ep)
                failed = [r["error"] for r in (truth, one, got) if "error" in r]
                if failed:
                    result["runs"][key] = {"error": failed[0], "ok": False}
                    continue
                cmp = compare(got["outputs"], one["outputs"])
                cmp["vs_float32_gap"] = compare(got["outputs"], truth["outputs"])[
                    "mean_abs_logprob_gap"
                ]
                cmp["one_vs_float32_gap"] = compare(one["outputs"], truth["outputs"])[
                    "mean_abs_logprob_gap"
                ]
                result["runs"][key] = {**cmp, "ok": judge(dtype, cmp, tol)}
    finally:
        shutil.rmtree(written["model"], ignore_errors=True)
    return result


# -- speed ----------------------------------------------------------------------------------------


def serve_command(
    engine: str, model: str, port: int, device: str, size: int, ep: bool, dp: bool = False
) -> list[str]:
    """served_gpu's command line for `engine` at `size` devices (both servers spell tensor and
    expert parallelism alike). Data-parallel attention: ember's flag; vLLM's equivalent for an
    MLA MoE model is `size` data-parallel engines of one GPU with the experts split across them
    (`--data-parallel-size N --enable-expert-parallel`)."""
    cmd = command(engine, model, port, device)
    if dp and engine == "vllm":
        return cmd + ["--data-parallel-size", str(size), "--enable-expert-parallel"]
    cmd += ["--tensor-parallel-size", str(size)]
    cmd += ["--enable-expert-parallel"] if ep else []
    return cmd + (["--enable-dp-attention"] if dp else [])


def engine_missing(engine: str, caches: Path) -> str | None:
    """Why `engine` cannot run here (vLLM not importable in its environment), or None."""
    if engine != "vllm":
        return None
    probe = [sys.executable, "-c", "import vllm"]
    done = subprocess.run(probe, env=environment(engine, caches), capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return "vLLM is not importable (scripts/vllm_device_env.sh unpacks it into $VLLM_SITE)"


def serve_runs(
    args: argparse.Namespace, engine: str, size: int, model: str, work: Path, loads: Loads
) -> dict[str, Any]:
    """The starts of one engine at one size; the loads on the last start."""
    slug = f"{engine}-tp{size}"
    caches = work / f"{slug}-caches"  # empty at the first start, kept for the next
    if reason := engine_missing(engine, caches):
        print(f"{slug} skipped: {reason}")
        return {"skipped": reason}
    starts = args.starts.split(",")
    runs: dict[str, Any] = {}
    for kind in starts:
        port = free_port("127.0.0.1")
        url, log = f"http://127.0.0.1:{port}", work / f"{slug}-{kind}.log"
        cmd = serve_command(
            engine,
            model,
            port,
            args.device,
            size,
            args.enable_expert_parallel,
            args.enable_dp_attention,
        )
        try:
            proc, ready_s = start(cmd, environment(engine, caches), url, log, args.ready_timeout)
        except (RuntimeError, TimeoutError) as e:
            runs[kind] = {"error": str(e)}
            break
        try:
            run: dict[str, Any] = {"ready_s": ready_s}
            if kind == starts[-1]:
                run |= run_loads(
                    url, work / "bench", f"{slug}-{kind}", ["mixed", "b1"], loads, False
                )
                run.pop("mixed_latency_s", None)
        finally:
            stop_processes([proc], 30.0)
        run["startup_log"] = startup_lines(log, limit=12)
        runs[kind] = run
    return runs


def roofline(report: dict[str, Any]) -> None:
    """Each b1 TPOT against its size's floor: a rank's bytes at the higher copy rate measured."""
    bw = max(r for rates in report["copy_bytes_per_s"].values() for r in rates)
    for engines in report["speed"].values():
        for size, runs in engines.items():
            floor_s = report["b1_rank_bytes"][size]["total"] / bw
            for run in runs.values():
                if isinstance(run, dict) and run.get("b1_tpot_ms"):
                    run["b1_roofline_frac"] = floor_s / (run["b1_tpot_ms"] / 1e3)


# -- the table ------------------------------------------------------------------------------------


def print_checks(checks: dict[str, Any]) -> None:
    print(
        "| model | run | identical | first token equal | mean / max logprob gap | "
        "to float32: N / one device | ok |"
    )
    print("|---|---|---|---|---|---|---|")
    for shape, check in checks.items():
        if "runs" not in check:
            print(f"| {shape} | {check.get('skipped') or check.get('error')} | | | | | no |")
            continue
        for key, r in check["runs"].items():
            if "error" in r:
                print(f"| {shape} | {key}: {r['error'][-160:]} | | | | | no |")
                continue
            print(
                f"| {shape} | {key} | {r['identical_frac']:.2f} | "
                f"{r['first_token_match_frac']:.2f} | {r['mean_abs_logprob_gap']:.1e} / "
                f"{r['max_abs_logprob_gap']:.1e} | {r['vs_float32_gap']:.1e} / "
                f"{r['one_vs_float32_gap']:.1e} | {'yes' if r['ok'] else 'NO'} |"
            )


def print_speed(report: dict[str, Any]) -> None:
    speed, last = report["speed"], report["starts"][-1]
    rates = "; ".join(
        f"{when}: " + ", ".join(f"{b / 1e9:,.0f}" for b in r)
        for when, r in report["copy_bytes_per_s"].items()
    )
    print(f"copy GB/s, device by device ({rates})")
    for size, b in report["b1_rank_bytes"].items():
        print(f"size {size}: a rank reads {b['total'] / 1e9:.3g} GB a batch-1 step")
    cols = [(e, s) for e, sizes in speed.items() for s in sizes]
    print("\n| | " + " | ".join(f"{e} x{s}" for e, s in cols) + " |")
    print("|---|" + "---|" * len(cols))

    def row(label: str, get) -> None:
        cells = []
        for e, s in cols:
            runs = speed[e][s]
            try:
                cells.append(get(runs))
            except (KeyError, TypeError):
                cells.append("skipped" if "skipped" in runs else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")

    starts = report["starts"]
    row(
        f"start to ready ({' / '.join(starts)})",
        lambda r: " / ".join(f"{r[k]['ready_s']:.1f}" for k in starts) + " s",
    )
    row("b1, TPOT p50", lambda r: f"{r[last]['b1_tpot_ms']:.2f} ms")
    row("b1, of the copy roofline", lambda r: f"{r[last]['b1_roofline_frac']:.3g}")
    row("mixed, output tok/s", lambda r: f"{r[last]['mixed']['output_throughput']:.0f}")
    for e, s in cols:
        for kind, run in speed[e][s].items():
            if isinstance(run, dict) and "error" in run:
                print(f"{e} x{s} {kind}: {run['error']}")


def print_table(report: dict[str, Any]) -> None:
    print(f"\n## {report['hardware']}, shape {report['shape']}: tensor parallel\n")
    if report.get("correctness"):
        print("Against one device, greedy:\n")
        print_checks(report["correctness"])
        print()
    if report.get("speed"):
        print_speed(report)


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama", choices=sorted(SHAPES))
    ap.add_argument("--tp", default="2", help="parallel sizes, comma-separated (2,4,8)")
    ap.add_argument("--enable-expert-parallel", action="store_true", help="MoE: whole experts")
    ap.add_argument(
        "--enable-dp-attention", action="store_true", help="MLA: each rank its own requests"
    )
    ap.add_argument("--engines", default="ember", help="ember, vllm or both (comma-separated)")
    ap.add_argument("--parts", default="correctness,speed")
    ap.add_argument("--layers", type=int, help="decoder layers served (default: the shape's)")
    ap.add_argument("--check-layers", type=int, default=4, help="decoder layers checked")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="the correctness dtypes")
    ap.add_argument("--starts", default="fresh,warm", help="server starts; loads on the last")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-spec", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cpu":
        if args.shape != "llama":
            ap.error("--device cpu runs its own tiny models; --shape is for GPUs")
        args.shape = "tiny"  # the smoke run's dense model; its MoE check runs beside
    if args.enable_expert_parallel and not SHAPES.get(args.shape, TINY).get("n_routed_experts"):
        ap.error(f"--enable-expert-parallel: {args.shape} has no experts")
    if args.enable_dp_attention and not SHAPES.get(args.shape, TINY).get("kv_lora_rank"):
        ap.error(f"--enable-dp-attention: {args.shape} has no latent attention")
    return args


def served_model(args: argparse.Namespace) -> tuple[str, dict]:
    """The speed part's model directory (dummy weights on a GPU; the smoke run's written
    tiny Llama on the CPU) and its config."""
    if args.device == "cpu":
        d = model_dir("tiny", TINY)
        write_weights(d, TINY)
        return str(d), TINY
    cfg = dict(SHAPES[args.shape])
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    return str(model_dir(args.shape, cfg)), cfg


def main() -> None:
    args = parse_args()
    if args.child:
        result = child(args.child, json.loads(args.child_spec))
        Path(args.child_out).write_text(json.dumps(result))
        return
    sizes = [int(s) for s in args.tp.split(",")]
    parts = args.parts.split(",")
    work = Path(tempfile.mkdtemp(prefix="parallel-gpu-"))
    gpus = max(sizes)
    ceil = run_child("ceilings", {"device": args.device, "gpus": gpus}, work)
    if "error" in ceil:
        raise SystemExit(f"copy bandwidth: {ceil['error']}")
    gpu = ceil["gpu"]
    hardware = "cpu" if args.device == "cpu" else f"{gpus}x{hardware_label(gpu)}"
    tag = args.shape + (f"-{args.layers}L" if args.layers else "")
    tag += "-ep" if args.enable_expert_parallel else ""
    tag += "-dp" if args.enable_dp_attention else ""
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out = result_path("parallel_gpu", hardware, tag=tag, out_dir=out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "gpu": gpu,
        "hardware": hardware,
        "shape": args.shape,
        "layers": args.layers,
        "expert_parallel": args.enable_expert_parallel,
        "dp_attention": args.enable_dp_attention,
        "sizes": sizes,
        "starts": args.starts.split(","),
        "copy_bytes_per_s": {"before": ceil["copy_bytes_per_s"]},
    }

    def save() -> None:
        out.write_text(json.dumps(report, indent=1))

    if "correctness" in parts:
        report["correctness"] = {}
        # The smoke run checks its tiny DeepSeek-V3 beside, with whole experts a rank and
        # data-parallel attention.
        checks = [(args.shape, args.enable_expert_parallel, args.enable_dp_attention)]
        checks += [("tiny_moe", True, True)] if args.device == "cpu" else []
        for shape, ep, dp in checks:
            report["correctness"][shape] = correctness(shape, sizes, ep, args, work, dp)
            save()
    if "speed" in parts:
        model, cfg = served_model(args)
        loads = CPU_LOADS if args.device == "cpu" else GPU_LOADS
        _, prompt, output = loads.b1
        report["loads"] = loads.__dict__
        report["b1_rank_bytes"] = {
            str(s): rank_step_bytes(cfg, s, prompt + output / 2, args.enable_dp_attention)
            for s in sizes
        }
        report["speed"] = {}
        for engine in args.engines.split(","):
            report["speed"][engine] = {}
            for size in sizes:
                runs = serve_runs(args, engine, size, model, work, loads)
                report["speed"][engine][str(size)] = runs
                save()
        after = run_child("ceilings", {"device": args.device, "gpus": gpus}, work)
        if "error" not in after:
            report["copy_bytes_per_s"]["after"] = after["copy_bytes_per_s"]
        roofline(report)
    save()
    print_table(report)
    print(f"wrote {out} (logs in {work})")


if __name__ == "__main__":
    main()
