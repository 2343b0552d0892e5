"""Quantized weights on one GPU: decode time against the bytes it must read, against bf16 on the
same shape, and greedy tokens against the same weights dequantized, all measured in one run.

Dummy weights throughout (`load_format="dummy"`: a config.json with a `quantization_config` gives
quantized layers with random packed INT4 / FP8 tensors), so "the same checkpoint" is the same
config.json. The ceiling (device-to-device copy bandwidth) and the baselines run in the same run.

- **moonlight**: the Moonlight-16B-A3B shape in Kimi K2.5's scheme (compressed-tensors
  pack-quantized INT4, group 32, symmetric, on the routed experts only; attention, shared experts,
  the dense first MLP and lm_head in bf16). Decode TPOT at batch 1 through the engine core (CUDA
  graphs; 1 prompt of 128 tokens, 256 out, ignore_eos; median of 3) against its roofline: the
  bytes a step reads (the bf16 weights every token reads, the top-k experts' packed weights and
  scales per MoE layer, the KV of the mean context) at the copy bandwidth; the same shape with
  bf16 experts; and the mixed load 256 x (1024 in, 256 out): output tok/s and mean TPOT.
- **llama**: the Llama-3.1-8B shape in W4A16 (INT4 group 128, symmetric, every Linear but
  lm_head): decode TPOT at batch 1 against ember's bf16 on the same shape, and its roofline.
- **kimi**: Kimi K2's layer in DeepSeek's FP8 blocks (`quant_method: fp8`, 128 x 128; hidden
  7168, MLA with 64 heads, 384 experts top-8 + 1 shared, all layers MoE), built directly with 4
  layers on the GPU: one layer's decode forward at batch 1, 64 and 256 (1024 tokens of context
  each), its attention, its MoE block (router, routing, experts) and `fused_moe_fp8` alone on the
  layer's routes, each replayed from a CUDA graph over the 4 layers (so no layer's weights sit in
  L2 from the replay before) and divided by 4, against the bytes each reads at the copy bandwidth.
  The `vllm_ms` of these rows is left null: vLLM's figures (its block-FP8 fused MoE and its
  DeepseekV2DecoderLayer forward at the same dims and batches, from a run of vLLM on the same
  GPU) are a separate step, not measured here.
- **quality**: Moonlight INT4 (K2.5 scheme) and 8B W4A16, each with 4 layers, against a bf16
  model of the same config without quantization_config holding the same weights dequantized
  (ember/kernels/quant_ref.py): 64 random prompts of 32 tokens x 64 greedy tokens, one batch
  through each model's engine core; the share of prompts whose tokens are identical and the mean
  |logprob gap| of the chosen tokens over the positions where both models saw the same context
  (the common prefix and the position after it). Random dummy weights give flat logits, so
  near-ties between the top two tokens are common and one rounding difference can flip a greedy
  choice: a split there is not by itself a kernel error (a wrong kernel shows as different first
  tokens and large gaps).

Every engine load, the Kimi layers and each quality comparison run in a process of their own (a
fresh GPU each; one that fails is reported and the rest go on). The engines run without a host
KV tier; a load timed at batch 1 only runs with 8 sequences and no start-up warm-up (a shorter
start, the same batch-1 graph). Prints one table (load, figure, ceiling or baseline, ratio, goal,
vLLM) and writes every raw number with the GPU, torch and Triton versions and the date to
benchmarks/results/quantized_gpu-<GPU>-<date>.json (`-quick` appended for `--quick`; in $OUT/
when set), after each task.

    python benchmarks/quantized_gpu.py [--parts moonlight,llama,kimi,quality] [--quick]
        [--bf16-mixed] [--dry]

`--quick`: the quantized loads' code paths once at small sizes (engine models of 4 layers, 64
decode tokens, 32 mixed requests, 2 Kimi layers, quality 2 layers x 16 prompts x 16 tokens; no
bf16 baselines), to check the script on a GPU; its figures mean little. `--bf16-mixed`: the
mixed load on the bf16 Moonlight too (the INT4 row's baseline). `--dry`: on the CPU, every part
at toy sizes (2 layers, a few tokens, 16 Kimi experts) through the same code; its timings mean
nothing: it checks the configs, the models, the dequantized copy and the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gpu import (  # noqa: E402
    SHAPES,
    Run,
    ceilings,
    decode_steps,
    engine_config,
    graph_ms,
    is_mla,
    kv_bytes_per_token,
    moe_dims,
    random_prompts,
)
from benchmarks.quant_schemes import KIMI_K2, KIMI_K25_INT4, W4A16_G128  # noqa: E402
from benchmarks.result_names import result_path  # noqa: E402
from ember.attention.context import ForwardContext  # noqa: E402
from ember.engine.core import EngineCore, default_backend  # noqa: E402
from ember.engine.messages import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from ember.engine.model_runner import ModelRunner  # noqa: E402
from ember.engine.warmup import dummy_inputs  # noqa: E402
from ember.kernels.quant_ref import dequantize_fp8, dequantize_int  # noqa: E402
from ember.models.config import ModelConfig  # noqa: E402
from ember.models.layers.moe import grouped_topk  # noqa: E402
from ember.models.layers.quant_linear import QuantLinear  # noqa: E402
from ember.models.layers.quant_moe import QuantFusedMoE  # noqa: E402
from ember.models.loader import build_model, init_dummy_weights  # noqa: E402
from ember.models.quant_config import WeightQuant, parse_quant_config  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402

LOADS: dict[str, tuple[str, dict | None]] = {
    "moonlight_int4": ("moonlight", KIMI_K25_INT4),
    "moonlight_bf16": ("moonlight", None),
    "llama_w4a16": ("llama", W4A16_G128),
    "llama_bf16": ("llama", None),
}
"""Engine loads: (shape in engine_gpu.SHAPES, quantization_config or None for bf16)."""
PARTS = {
    "moonlight": ("moonlight_int4", "moonlight_bf16"),
    "llama": ("llama_w4a16", "llama_bf16"),
    "kimi": ("kimi_fp8",),
    "quality": ("quality_moonlight", "quality_llama"),
}
"""Each part's tasks, one process each."""
QUICK_SKIPS = ("moonlight_bf16", "llama_bf16")
"""The bf16 baselines, which `--quick` leaves out: the same code as the quantized loads."""


@dataclass(frozen=True, slots=True)
class Sizes:
    """A run's sizes: the default (full), `--quick` and `--dry`."""

    decode_reps: int
    decode_in: int
    decode_out: int
    mixed_n: int
    mixed_in: int
    mixed_out: int
    kimi_layers: int
    kimi_batches: tuple[int, ...]
    kimi_ctx: int
    quality_layers: int
    quality_prompts: int
    quality_in: int
    quality_out: int
    iters: int
    layers: int | None = None
    """Engine loads' layers: the shape's own (None), or fewer (quick and dry runs)."""
    kimi_experts: int | None = None
    """Kimi's routed experts: 384 (None), or fewer (a dry run on the CPU)."""
    kimi_vocab: int | None = None


_FULL = Sizes(
    decode_reps=3,
    decode_in=128,
    decode_out=256,
    mixed_n=256,
    mixed_in=1024,
    mixed_out=256,
    kimi_layers=4,
    kimi_batches=(1, 64, 256),
    kimi_ctx=1024,
    quality_layers=4,
    quality_prompts=64,
    quality_in=32,
    quality_out=64,
    iters=20,
)
SIZES = {
    "full": _FULL,
    # Every code path once, on 4-layer engine models: the kernels' compiles are the same.
    "quick": dataclasses.replace(
        _FULL,
        decode_reps=1,
        decode_out=64,
        mixed_n=32,
        mixed_out=32,
        kimi_layers=2,
        quality_layers=2,
        quality_prompts=16,
        quality_out=16,
        iters=5,
        layers=4,
    ),
    "dry": Sizes(
        decode_reps=1,
        decode_in=16,
        decode_out=4,
        mixed_n=2,
        mixed_in=16,
        mixed_out=3,
        kimi_layers=1,
        kimi_batches=(1, 4),
        kimi_ctx=32,
        quality_layers=2,
        quality_prompts=3,
        quality_in=8,
        quality_out=4,
        iters=1,
        layers=2,
        kimi_experts=16,
        kimi_vocab=32000,
    ),
}


def sizes_of(args: argparse.Namespace) -> Sizes:
    return SIZES["dry" if args.dry else "quick" if args.quick else "full"]


# -- configs and the bytes a step reads ---------------------------------------------------------


def load_config(load: str, layers: int | None = None) -> dict[str, Any]:
    """config.json of an engine load, with `layers` decoder layers if given."""
    shape, quant = LOADS[load]
    cfg = dict(SHAPES[shape])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def kimi_config(layers: int, experts: int | None = None, vocab: int | None = None) -> dict:
    cfg = {**KIMI_K2, "num_hidden_layers": layers}
    if experts is not None:
        cfg["n_routed_experts"] = experts
    if vocab is not None:
        cfg["vocab_size"] = vocab
    return cfg


def model_dir(cfg: dict[str, Any]) -> Path:
    """A model directory holding only `cfg` as its config.json (the weights are dummy)."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp


def param_groups(cfg: dict[str, Any]) -> dict[str, int]:
    """The model's parameters by what they are (norms: every RMSNorm weight; the embedding
    table is a lookup, the lm_head a read); `expert`: one routed expert's."""
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    moe_layers, experts, _ = moe_dims(cfg)
    if is_mla(cfg):
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        rank, q_lora = cfg["kv_lora_rank"], cfg.get("q_lora_rank") or 0
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        attn = q + h * (rank + rope) + heads * v * h
        kv_b = rank * heads * (nope + v)
        norms = 2 * h + rank + q_lora
    else:
        kv, d = cfg["num_key_value_heads"], cfg.get("head_dim", h // heads)
        attn, kv_b, norms = h * heads * d + 2 * h * kv * d + heads * d * h, 0, 2 * h
    expert = 3 * h * cfg.get("moe_intermediate_size", 0)
    table = cfg["vocab_size"] * h
    return {
        "attention": layers * attn,
        "kv_b": layers * kv_b,
        "dense_mlp": (layers - moe_layers) * 3 * h * cfg["intermediate_size"],
        "shared_experts": moe_layers * cfg.get("n_shared_experts", 0) * expert,
        "router": moe_layers * h * experts,
        "routed_experts": moe_layers * experts * expert,
        "norms": layers * norms + h,
        "embedding": table,
        "lm_head": 0 if cfg["tie_word_embeddings"] else table,
        "expert": expert,
    }


def scheme_bytes(scheme: WeightQuant | None) -> float:
    """Bytes one parameter takes stored as `scheme` (its scales and zero points included):
    bf16 when None. Group scales are bf16 (the checkpoint's dtype), FP8 block scales float32."""
    if scheme is None:
        return 2.0
    if scheme.kind == "int":
        per_group = 2 + (0 if scheme.symmetric else 1)
        return scheme.bits / 8 + (per_group / scheme.group_size if scheme.group_size else 0)
    rows, cols = scheme.block
    return 1.0 + (4 / (rows * cols) if cols else 0.0)


def bytes_per_param(cfg: dict[str, Any]) -> dict[str, float]:
    """Each param_groups group's bytes a parameter, as ember's parser reads the config's
    quantization_config (asked about one checkpoint name of the group)."""
    quant = parse_quant_config(cfg.get("quantization_config"))
    dense = cfg.get("first_k_dense_replace", 0)
    moe = f"model.layers.{dense}.mlp"
    names = {
        "attention": "model.layers.0.self_attn.o_proj",
        "dense_mlp": "model.layers.0.mlp.down_proj",
        "shared_experts": f"{moe}.shared_experts.down_proj",
        "routed_experts": f"{moe}.experts.0.down_proj",
        "lm_head": "lm_head",
    }
    out = {g: scheme_bytes(quant.scheme_for(n) if quant else None) for g, n in names.items()}
    # kv_b_proj stays in the model's dtype (attention splits it per head); the router is fp32.
    return {**out, "kv_b": 2.0, "router": 4.0, "norms": 2.0, "embedding": 2.0}


def model_bytes(cfg: dict[str, Any]) -> float:
    """The model's weight bytes on the device."""
    groups, per = param_groups(cfg), bytes_per_param(cfg)
    return sum(n * per[g] for g, n in groups.items() if g != "expert")


def decode_bytes(cfg: dict[str, Any], batch: int, context: float) -> dict[str, float]:
    """Bytes a decode step of `batch` tokens reads: every weight a token reads (not the
    embedding table, a lookup), the routed experts the batch hits (E * (1 - (1 - k/E)^batch) in
    expectation under uniform routing: k at batch 1), and the KV of `context` tokens a row."""
    groups, per = param_groups(cfg), bytes_per_param(cfg)
    always = ("attention", "kv_b", "dense_mlp", "shared_experts", "router", "norms", "lm_head")
    moe_layers, experts, top_k = moe_dims(cfg)
    hit = experts * (1 - (1 - top_k / experts) ** batch) if experts else 0.0
    weights = sum(groups[g] * per[g] for g in always)
    weights += moe_layers * hit * groups["expert"] * per["routed_experts"]
    kv = batch * context * kv_bytes_per_token(cfg)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def layer_bytes(cfg: dict[str, Any], batch: int, context: int) -> dict[str, float]:
    """Bytes one MoE layer's decode step of `batch` tokens reads, by part: attention (its
    weights and the KV of `context` tokens a row), the MoE block (router, shared and hit
    experts), the fused MoE kernel (shared and hit experts) and the whole layer."""
    groups, per = param_groups(cfg), bytes_per_param(cfg)
    layers = cfg["num_hidden_layers"]
    moe_layers, experts, top_k = moe_dims(cfg)
    if moe_layers != layers:
        raise ValueError("layer_bytes counts a model whose every layer is MoE")
    hit = experts * (1 - (1 - top_k / experts) ** batch)
    attn = (groups["attention"] * per["attention"] + groups["kv_b"] * 2) / layers
    attn += batch * context * kv_bytes_per_token(cfg) / layers
    kernel = groups["shared_experts"] * per["shared_experts"] / layers
    kernel += hit * groups["expert"] * per["routed_experts"]
    moe = kernel + groups["router"] * 4 / layers
    return {"layer": attn + moe, "attention": attn, "moe_block": moe, "fused_moe_fp8": kernel}


# -- engine runs -----------------------------------------------------------------------------------


class OutputLog:
    """What the core's steps return, as it arrives: each request's tokens, their logprobs and the
    host time each came. Wraps `core.step`, so engine_gpu's `Run` drives it unchanged. A request
    the engine ended with an error raises here (the core would carry on without it)."""

    def __init__(self, core: EngineCore) -> None:
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.logprobs: dict[str, list[float]] = defaultdict(list)
        self.times: dict[str, list[float]] = defaultdict(list)
        step = core.step

        def logged() -> list[EngineCoreOutput]:
            outs = step()
            now = time.perf_counter()
            for o in outs:
                if o.finish_reason == "error":
                    raise RuntimeError(f"request {o.request_id} failed: {o.stop_reason}")
                self.tokens[o.request_id] += o.new_token_ids
                self.times[o.request_id] += [now] * len(o.new_token_ids)
                self.logprobs[o.request_id] += [e[0][1] for e in o.new_logprobs or ()]
            return outs

        core.step = logged  # type: ignore[method-assign]

    def clear(self) -> None:
        self.tokens.clear()
        self.logprobs.clear()
        self.times.clear()

    def mean_tpot_s(self) -> float:
        """Mean over the requests of (last token's time - first's) / (tokens - 1)."""
        per = [(t[-1] - t[0]) / (len(t) - 1) for t in self.times.values() if len(t) > 1]
        return statistics.fmean(per)


def engine_settings(sizes: Sizes, serving: bool, device: str) -> dict[str, object]:
    """EngineConfig overrides of engine_gpu's settings. No host KV tier (its memory is pinned in
    the background, beside the timed steps). A load timed at batch 1 only (`serving` False) gets
    8 sequences and no start-up warm-up: a shorter start, the same batch-1 graph. A dry run: the
    CPU, a small context and KV pool."""
    if device == "cpu":
        return dict(
            device="cpu",
            max_model_len=256,
            max_num_batched_tokens=256,
            num_kv_blocks=64,
            max_num_seqs=8,
            kv_host_gb=0,
        )
    if not serving:
        return dict(max_num_seqs=8, warmup=False, kv_host_gb=0)
    return dict(max_num_seqs=min(sizes.mixed_n, 256), kv_host_gb=0)


def bench_engine(load: str, sizes: Sizes, bw: float, mixed: bool, device: str) -> dict:
    """Decode TPOT at batch 1 (and with `mixed`, the mixed load) of one load on the engine core."""
    cfg = load_config(load, sizes.layers)
    vocab = cfg["vocab_size"]
    t0 = time.perf_counter()
    settings = engine_settings(sizes, mixed, device)
    core = EngineCore(engine_config(model_dir(cfg), **settings))
    if device == "cuda":
        torch.cuda.synchronize()
    out: dict[str, Any] = {
        "load": load,
        "layers": cfg["num_hidden_layers"],
        "engine_settings": settings,
        "startup_s": time.perf_counter() - t0,
        "weight_bytes": model_bytes(cfg),
        "quantization": core.model_config.quant.describe() if core.model_config.quant else None,
    }
    core.runner.gpu_timing = device == "cuda"
    log, run = OutputLog(core), Run(core)
    steps, exposed = [], []
    for rep in range(sizes.decode_reps):
        res = run(random_prompts(1, sizes.decode_in, vocab, rep), sizes.decode_out)
        ds = decode_steps(res)
        steps.append(statistics.median(s[0] for s in ds))
        exposed.append(statistics.median(s[1] / s[0] for s in ds))
    tpot = statistics.median(steps)
    read = decode_bytes(cfg, 1, sizes.decode_in + sizes.decode_out / 2)
    out["decode_b1"] = {
        "prompt": sizes.decode_in,
        "output": sizes.decode_out,
        "tpot_ms_per_rep": [s * 1e3 for s in steps],
        "tpot_ms": tpot * 1e3,
        "tok_s": 1 / tpot,
        "host_exposed_share": statistics.median(exposed),
        "bytes": read,
        "roofline_ms": read["total"] / bw * 1e3,
        "roofline_frac": read["total"] / bw / tpot,
    }
    if mixed:
        n = sizes.mixed_n
        capacity = core.num_kv_blocks * core.config.block_size
        length = min(sizes.mixed_in, capacity // n - sizes.mixed_out)
        log.clear()
        res = run(random_prompts(n, length, vocab, 13), sizes.mixed_out)
        out["mixed"] = {
            "requests": n,
            "prompt": length,
            "output": sizes.mixed_out,
            "wall_s": res["wall_s"],
            "output_tok_s": res["generated"] / res["wall_s"],
            "mean_tpot_ms": log.mean_tpot_s() * 1e3,
        }
    return out


# -- Kimi K2's layer in FP8 blocks ----------------------------------------------------------------


def time_ms(fn: Callable[[], None], iters: int, device: str) -> float:
    """fn's GPU time replayed from a CUDA graph; on the CPU (a dry run) one call's wall time."""
    if device == "cuda":
        return graph_ms(fn, iters=iters)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def layer_parts(
    layers: list[nn.Module],
    mc: ModelConfig,
    pos: torch.Tensor,
    x: torch.Tensor,
    ctx: ForwardContext,
    experts_fn: Callable[..., torch.Tensor],
) -> dict[str, Callable[[], None]]:
    """What bench_kimi times, each over every layer in turn: the decoder layers chained, their
    attention, their MoE blocks (router, routing, experts) and the experts kernel alone on each
    layer's routes (taken once, outside the timing), all on the same normed input."""
    xn = layers[0].input_layernorm(x)
    routes = [
        grouped_topk(
            layer.mlp.gate(xn),
            layer.mlp.gate.e_score_correction_bias,
            mc.num_experts_per_tok,
            mc.n_group,
            mc.topk_group,
            mc.norm_topk_prob,
            mc.routed_scaling_factor,
            num_shared=layer.mlp.experts.num_shared,
        )
        for layer in layers
    ]

    def whole() -> None:
        h, residual = x, None
        for layer in layers:
            h, residual = layer(pos, h, residual, ctx)

    def attention() -> None:
        for layer in layers:
            layer.self_attn(pos, xn, ctx)

    def moe() -> None:
        for layer in layers:
            layer.mlp(xn)

    def kernel() -> None:
        for layer, (weights, chosen) in zip(layers, routes, strict=True):
            e = layer.mlp.experts
            experts_fn(xn, e.w13, e.w13_scale, e.w2, e.w2_scale, weights, chosen, e.block13)

    return {"layer": whole, "attention": attention, "moe_block": moe, "fused_moe_fp8": kernel}


def bench_kimi(sizes: Sizes, bw: float, device: str) -> dict:
    """Kimi K2's MoE layer in FP8 blocks, built directly (dummy weights): the layer, its
    attention, its MoE block and fused_moe_fp8 alone at each decode batch (see the docstring)."""
    from ember.engine.config import default_block_size
    from ember.kernels.quant_ref import routed_experts_fp8_ref

    if device == "cuda":
        from ember.kernels import triton_setup
        from ember.kernels.fused_moe import fused_moe_fp8

        triton_setup.start()  # Triton's set-up, in the engines' cache, while the model builds
        experts_fn = fused_moe_fp8
    else:
        experts_fn = routed_experts_fp8_ref
    cfg = kimi_config(sizes.kimi_layers, sizes.kimi_experts, sizes.kimi_vocab)
    mc = ModelConfig.from_dict(cfg)
    t0 = time.perf_counter()
    model = build_model(model_dir(cfg), mc, torch.bfloat16, device, "dummy")
    init_dummy_weights(model)
    if device == "cuda":
        torch.cuda.synchronize()
    out: dict[str, Any] = {
        "config": {k: v for k, v in cfg.items() if k != "quantization_config"},
        "quantization": mc.quant.describe() if mc.quant else None,
        "build_s": time.perf_counter() - t0,
        "context": sizes.kimi_ctx,
        "vllm_ms": None,
        "batches": {},
    }
    backend = default_backend(torch.device(device))
    block = default_block_size(device)
    ctx_len, batches = sizes.kimi_ctx, sizes.kimi_batches
    blocks = max(batches) * -(-(ctx_len + 1) // block)
    runner = ModelRunner(
        model, mc, block, torch.bfloat16, torch.device(device), backend, blocks, max(batches)
    )
    layers = list(model.model.layers)
    g = torch.Generator(device=device).manual_seed(0)

    def parts_at(b: int) -> dict[str, Callable[[], None]]:
        _, pos, md = dummy_inputs(runner, [(1, ctx_len)] * b)
        x = torch.randn(b, mc.hidden_size, device=device, generator=g).bfloat16()
        ctx = ForwardContext(md, runner.kv_cache, backend)
        return layer_parts(layers, mc, pos, x, ctx, experts_fn)

    with torch.inference_mode():
        if device == "cuda":
            # Every Triton variant the timings meet, compiled at once in parallel, as an
            # engine's start-up does (ember/kernels/precompile.py), not one by one as met.
            from ember.kernels import triton_setup
            from ember.kernels.precompile import precompile

            triton_setup.wait()

            def run_dry() -> None:
                for b in batches:
                    for part in parts_at(b).values():
                        part()

            done = precompile(run_dry, processes=True)
            out["precompile"] = {"variants": done.variants, "s": done.dry_s + done.compile_s}
        for b in batches:
            parts = parts_at(b)
            read = layer_bytes(cfg, b, ctx_len)
            row: dict[str, Any] = {}
            for name, fn in parts.items():
                ms = time_ms(fn, sizes.iters, device) / len(layers)
                floor = read[name] / bw * 1e3
                row[name] = {
                    "ms": ms,
                    "bytes": read[name],
                    "roofline_ms": floor,
                    "roofline_frac": floor / ms,
                    "vllm_ms": None,
                }
            out["batches"][str(b)] = row
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


# -- quality: quantized against the same weights dequantized -------------------------------------

_SHARED_MLP = re.compile(r"^(.*\.mlp)\.shared_experts\.(gate_up_proj|down_proj)\.weight$")


def dequantized_linear(layer: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """A QuantLinear's weight [out, in] in `dtype`, as quant_ref computes it."""
    q = layer.quant
    if q.kind == "int":
        zero = getattr(layer, "weight_zero_point", None)
        return dequantize_int(
            layer.weight_packed,
            layer.weight_scale,
            zero,
            q.bits,
            layer.group_size,
            layer.in_features,
            dtype,
        )
    return dequantize_fp8(layer.weight, layer.weight_scale, layer.block, dtype)


def dequantized_expert(moe: QuantFusedMoE, w: str, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's w13 [2I, H] or w2 [H, I] of a QuantFusedMoE in `dtype`."""
    q = moe.quant
    if q.kind == "int":
        k = moe.hidden_size if w == "w13" else moe.intermediate_size
        group = moe.group_size if w == "w13" else moe.down_group
        zero = getattr(moe, f"{w}_zero_point", None)
        return dequantize_int(
            getattr(moe, f"{w}_packed")[e],
            getattr(moe, f"{w}_scale")[e],
            None if zero is None else zero[e],
            q.bits,
            group,
            k,
            dtype,
        )
    block = moe.block13 if w == "w13" else moe.block2
    return dequantize_fp8(getattr(moe, w)[e], getattr(moe, f"{w}_scale")[e], block, dtype)


@torch.no_grad()
def copy_dequantized(src: nn.Module, dst: nn.Module) -> None:
    """Fill `dst`, built from `src`'s config without quantization_config, with `src`'s weights:
    its quantized layers dequantized, the rest copied. A shared MLP `src` keeps apart (K2.5's
    bf16 shared experts beside INT4 routed ones) goes into the shared slots of `dst`'s experts,
    where an unquantized model stacks them. Raises if any parameter of `dst` is left unfilled."""
    params = dict(dst.named_parameters())
    filled: set[str] = set()

    def put(name: str, value: torch.Tensor) -> None:
        target = params[name]
        if target.shape != value.shape:
            raise ValueError(f"{name}: {tuple(value.shape)} into {tuple(target.shape)}")
        target.copy_(value)
        filled.add(name)

    owned: set[int] = set()
    for name, module in src.named_modules():
        if isinstance(module, QuantLinear):
            put(f"{name}.weight", dequantized_linear(module, params[f"{name}.weight"].dtype))
            if module.bias is not None:
                put(f"{name}.bias", module.bias)
        elif isinstance(module, QuantFusedMoE):
            for w in ("w13", "w2"):
                target = params[f"{name}.{w}"]
                total = module.num_experts + module.num_shared
                for e in range(total):
                    target[e].copy_(dequantized_expert(module, w, e, target.dtype))
                if total == target.shape[0]:
                    filled.add(f"{name}.{w}")
        else:
            continue
        owned.update(id(p) for p in module.parameters())
    for name, p in src.named_parameters():
        if id(p) in owned:
            continue
        if name in params:
            put(name, p)
            continue
        m = _SHARED_MLP.match(name)
        if m is None:
            raise ValueError(f"{name} of the quantized model has no place in the bf16 one")
        experts = dst.get_submodule(f"{m.group(1)}.experts")
        if m.group(2) == "down_proj":
            experts.weight_loader(experts.w2, p, "shared.down")
        else:
            gate, up = p.chunk(2, dim=0)
            experts.weight_loader(experts.w13, gate, "shared.gate")
            experts.weight_loader(experts.w13, up, "shared.up")
        owner = f"{m.group(1)}.experts.{'w2' if m.group(2) == 'down_proj' else 'w13'}"
        filled.add(owner)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"the dequantized model's {missing[:6]} were not filled")


def greedy(core: EngineCore, log: OutputLog, prompts: list[list[int]], n: int) -> list[tuple]:
    """Each prompt's n greedy tokens and their logprobs, all prompts in one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    log.clear()
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"q{i}", p, params, [], max_tokens=n))
    while core.has_unfinished_requests():
        core.step()
    return [(log.tokens[f"q{i}"], log.logprobs[f"q{i}"]) for i in range(len(prompts))]


def compare(quant: list[tuple], dense: list[tuple]) -> dict[str, Any]:
    """Identical greedy outputs, and |logprob gap| of the chosen tokens over the positions where
    both models saw the same context (the common prefix and the position after it)."""
    prefixes, gaps, per_prompt = [], [], []
    for (tq, lq), (td, ld) in zip(quant, dense, strict=True):
        if len(tq) != len(td) or len(lq) != len(tq) or len(ld) != len(td):
            raise RuntimeError("a request returned fewer tokens or logprobs than asked")
        n = next((i for i, (a, b) in enumerate(zip(tq, td, strict=True)) if a != b), len(tq))
        prefixes.append(n)
        mine = [abs(a - b) for a, b in zip(lq[: n + 1], ld[: n + 1], strict=True)]
        gaps += mine
        per_prompt.append(statistics.fmean(mine))
    return {
        "prompts": len(quant),
        "tokens": len(quant[0][0]),
        "identical_frac": sum(p == len(quant[0][0]) for p in prefixes) / len(prefixes),
        "first_token_match_frac": sum(p > 0 for p in prefixes) / len(prefixes),
        "common_prefix": prefixes,
        "mean_abs_logprob_gap": statistics.fmean(gaps),
        "max_abs_logprob_gap": max(gaps),
        "mean_abs_logprob_gap_per_prompt": per_prompt,
    }


def bench_quality(load: str, sizes: Sizes, device: str) -> dict:
    """A quantized load's greedy tokens against its dequantized bf16 twin's (the docstring)."""
    n, length, new = sizes.quality_prompts, sizes.quality_in, sizes.quality_out
    block = 16 if device == "cpu" else 64
    settings: dict[str, object] = dict(
        max_model_len=256,
        max_num_seqs=n,
        max_cuda_graph_batch=n,
        max_num_batched_tokens=max(256, n * length),
        num_kv_blocks=n * -(-(length + new) // block) + 256 // block,
        warmup=False,
        kv_host_gb=0,
    )
    if device == "cpu":
        settings["device"] = "cpu"
    cfg = load_config(load, sizes.quality_layers)
    dense_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    qcore = EngineCore(engine_config(model_dir(cfg), **settings))
    dcore = EngineCore(engine_config(model_dir(dense_cfg), **settings))
    copy_dequantized(qcore.runner.model, dcore.runner.model)
    prompts = random_prompts(n, length, cfg["vocab_size"], 21)
    q = greedy(qcore, OutputLog(qcore), prompts, new)
    d = greedy(dcore, OutputLog(dcore), prompts, new)
    return {"load": load, "layers": sizes.quality_layers, "prompt": length, **compare(q, d)}


# -- processes, the table ----------------------------------------------------------------------

H200_COPY_BYTES_PER_S = 4.0e12
"""A dry run's stand-in for the measured copy bandwidth (no GPU to measure)."""


def child(task: str, args: argparse.Namespace) -> dict[str, Any]:
    """One task in a process of its own: "ceilings", an engine load, "kimi_fp8" or a quality
    comparison."""
    device = "cpu" if args.dry else "cuda"
    sizes = sizes_of(args)
    if task == "ceilings":
        if args.dry:
            return {"gpu": None, "ceilings": {"copy_bytes_per_s": H200_COPY_BYTES_PER_S}}
        return {"gpu": torch.cuda.get_device_name(), "ceilings": ceilings()}
    bw = json.loads(args.ceilings)["copy_bytes_per_s"]
    if task in LOADS:
        serving = task == "moonlight_int4" or (task == "moonlight_bf16" and args.bf16_mixed)
        return bench_engine(task, sizes, bw, serving, device)
    if task == "kimi_fp8":
        return bench_kimi(sizes, bw, device)
    if task.startswith("quality_"):
        load = {"quality_moonlight": "moonlight_int4", "quality_llama": "llama_w4a16"}[task]
        return bench_quality(load, sizes, device)
    raise ValueError(f"unknown task {task!r}")


def run_child(task: str, args: argparse.Namespace, ceil: dict | None) -> dict[str, Any]:
    """The task's result, or {"error": ...} if its process failed (its traceback is in the
    output): the parts after it still run."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", task, "--child-out", f.name]
        cmd += ["--ceilings", json.dumps(ceil or {})]
        flags = {"--quick": args.quick, "--dry": args.dry, "--bf16-mixed": args.bf16_mixed}
        cmd += [flag for flag, on in flags.items() if on]
        rc = subprocess.run(cmd).returncode
        if rc:
            return {"error": f"{task} exited with status {rc}"}
        return json.loads(Path(f.name).read_text())


Row = tuple[str, str, str, str, str, str]
QUALITY_NAMES = {"quality_moonlight": "Moonlight INT4", "quality_llama": "Llama-8B W4A16"}


def _ms(v: float) -> str:
    return f"{v:.3f} ms" if v < 1 else f"{v:.2f} ms"


def _decode_row(label: str, r: dict[str, Any], goal: str = "") -> Row:
    d = r["decode_b1"]
    floor = f"roofline {_ms(d['roofline_ms'])} ({d['bytes']['total'] / 1e9:.2f} GB)"
    ratio = f"{d['roofline_frac']:.2f} of roofline"
    return (f"{label}, decode b1", f"TPOT {_ms(d['tpot_ms'])}", floor, ratio, goal, "")


def _speedup_row(label: str, quant: dict, dense: dict, goal: str = "") -> Row:
    q, d = quant["decode_b1"]["tpot_ms"], dense["decode_b1"]["tpot_ms"]
    return (label, f"TPOT {_ms(q)}", f"bf16 TPOT {_ms(d)}", f"{d / q:.2f}x faster", goal, "")


def table_rows(tasks: dict[str, dict[str, Any]]) -> list[Row]:
    """(load, figure, ceiling or baseline, ratio, goal, vLLM) for every result in `tasks`."""
    rows: list[Row] = [(t, r["error"], "", "", "", "") for t, r in tasks.items() if "error" in r]
    ok = {t: r for t, r in tasks.items() if "error" not in r}
    mi, mb = ok.get("moonlight_int4"), ok.get("moonlight_bf16")
    if mi:
        rows.append(_decode_row("Moonlight INT4 g32 (K2.5 scheme)", mi, ">= 0.70"))
    if mb:
        rows.append(_decode_row("Moonlight bf16", mb))
    if mi and mb:
        rows.append(_speedup_row("Moonlight INT4 vs bf16, decode b1", mi, mb))
    if mi and "mixed" in mi:
        m = mi["mixed"]
        load = f"Moonlight INT4, mixed {m['requests']} x ({m['prompt']} in, {m['output']} out)"
        figure = f"{m['output_tok_s']:.0f} out tok/s, mean TPOT {_ms(m['mean_tpot_ms'])}"
        base = ratio = ""
        if mb and "mixed" in mb:
            base = f"bf16 {mb['mixed']['output_tok_s']:.0f} tok/s"
            ratio = f"{m['output_tok_s'] / mb['mixed']['output_tok_s']:.2f}x"
        rows.append((load, figure, base, ratio, "", ""))
    lq, lb = ok.get("llama_w4a16"), ok.get("llama_bf16")
    if lq and lb:
        rows.append(_speedup_row("Llama-8B W4A16 g128 vs bf16, decode b1", lq, lb, ">= 2.5x"))
    if lq:
        rows.append(_decode_row("Llama-8B W4A16 g128", lq))
    if lb:
        rows.append(_decode_row("Llama-8B bf16", lb))
    for b, parts in ok.get("kimi_fp8", {}).get("batches", {}).items():
        for name, r in parts.items():
            floor = f"roofline {_ms(r['roofline_ms'])}"
            frac = f"{r['roofline_frac']:.2f} of roofline"
            vllm = "None (not measured)" if r["vllm_ms"] is None else _ms(r["vllm_ms"])
            rows.append((f"Kimi K2 FP8 layer, b{b}: {name}", _ms(r["ms"]), floor, frac, "", vllm))
    for task, name in QUALITY_NAMES.items():
        if task not in ok:
            continue
        q = ok[task]
        what = f"{name} vs dequantized bf16 ({q['layers']} layers), {q['prompts']} x {q['tokens']}"
        same = f"{q['identical_frac']:.2f} (first token {q['first_token_match_frac']:.2f})"
        rows.append((f"{what} greedy: identical", same, "", "", ">= 0.90", ""))
        gap = f"{q['mean_abs_logprob_gap']:.4f} (max {q['max_abs_logprob_gap']:.3f})"
        rows.append((f"{what}: mean abs logprob gap", gap, "", "", "", ""))
    return rows


def print_table(gpu: str | None, ceil: dict[str, float], rows: list[Row]) -> None:
    print(f"\nGPU: {gpu}; copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s", end="")
    if "matmul_flops" in ceil:
        print(f"; bf16 matmul {ceil['matmul_flops'] / 1e12:.0f} TFLOP/s", end="")
    print("\n| load | figure | ceiling / baseline | ratio | goal | vLLM |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    ap.add_argument("--bf16-mixed", action="store_true", help="the mixed load on bf16 too")
    ap.add_argument("--dry", action="store_true", help="on the CPU at toy sizes (no timings)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--ceilings", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out = child(args.child, args)
        Path(args.child_out).write_text(json.dumps(out, default=str))
        return
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    first = run_child("ceilings", args, None)
    if "error" in first:
        raise SystemExit(first["error"])
    gpu, ceil = first["gpu"], first["ceilings"]
    results: dict[str, Any] = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "sizes": dataclasses.asdict(sizes_of(args)),
        "args": vars(args),
        "ceilings": ceil,
        "tasks": {},
        "task_s": {},
    }
    out_dir = os.environ.get("OUT") or (tempfile.mkdtemp() if args.dry else None)
    tag = "dry" if args.dry else "quick" if args.quick else ""
    out = result_path("quantized_gpu", gpu, tag=tag, out_dir=out_dir)
    tasks = [t for p in parts for t in PARTS[p] if not (args.quick and t in QUICK_SKIPS)]
    for task in tasks:
        t0 = time.perf_counter()
        results["tasks"][task] = run_child(task, args, ceil)
        results["task_s"][task] = time.perf_counter() - t0
        out.write_text(json.dumps(results, indent=2, default=str))
    print_table(gpu, ceil, table_rows(results["tasks"]))
    print("\nseconds a task: " + ", ".join(f"{t} {s:.0f}" for t, s in results["task_s"].items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
