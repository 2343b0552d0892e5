"""ember's engine core on one GPU against the hardware's limits and HF transformers, in one run.

Measures, in the same process: the ceilings (device-to-device copy bandwidth, bf16 8192^3 matmul);
then for each model shape (Llama-3.1-8B, Qwen3-8B, and the MoE shapes Moonlight-16B-A3B (MLA,
DeepSeek-V3 architecture) and Qwen3-30B-A3B; dummy bf16 weights): startup (dummy init, KV
sizing, graph capture), decode at batch 1 (128 in / 512 out), decode at batch 8..256 with 1k
context, prefill 64 x 2048, the mixed load 256 x (1024 in, 256 out), host CPU share of a decode step
at batch 64, and, on Llama, HF transformers eager on the same weights (decode batch 1, the mixed
load) and the relative error of ember's logits against HF's. MoE shapes add the fused MoE kernel
against a dense batched GEMM of the same work, and MLA the KV tokens that fit against plain MHA in
the same memory; their decode rooflines count only the experts a batch hits. Prints a table, writes
benchmarks/results/engine_gpu-<GPU>-<date>.json (or $OUT/ when set).

    python benchmarks/engine_gpu.py [--shapes llama,qwen3,moonlight,qwen3_moe] [--skip-hf] [--quick]

A shape named with ":unfused" (`--shapes llama,llama:unfused`) runs with the rotation and the KV
write as two launches, the baseline of their fusion in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_names import result_path  # noqa: E402
from ember.engine.config import EngineConfig  # noqa: E402
from ember.engine.core import EngineCore  # noqa: E402
from ember.engine.messages import EngineCoreRequest  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402

SHAPES = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # moonshotai/Moonlight-16B-A3B: Kimi's small DeepSeek-V3-architecture model (MLA with no q
    # LoRA, 64 routed experts top-6 in one group, 2 shared, the first layer dense).
    "moonlight": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "routed_scaling_factor": 2.446,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "vocab_size": 163840,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 163584,
        "eos_token_id": 163585,
    },
    # Qwen/Qwen3-30B-A3B: 128 experts top-8, softmax routing, GQA attention.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


def median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn, iters: int = 50, chain: int = 1) -> float:
    """GPU time of fn replayed from a CUDA graph, in ms (mean over iters replays): what a step
    captured in a graph pays, without the host's launch gaps. With chain > 1 the graph holds
    that many calls back to back and the time is per call (a replay's own cost spread thin)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(chain):
            fn()
    for _ in range(3):
        graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters / chain


def copy_bandwidth() -> float:
    x = torch.randn((1 << 30) // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / (ms / 1e3)


def matmul_flops() -> float:
    """The card's bf16 matmul peak as measured here: an 8192^3 matmul's FLOP/s."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms / 1e3)


def ceilings() -> dict[str, float]:
    out = {"copy_bytes_per_s": copy_bandwidth(), "matmul_flops": matmul_flops()}
    torch.cuda.empty_cache()
    return out


def shape_dir(name: str) -> Path:
    """A model directory holding only the shape's config.json (the weights are dummy)."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(SHAPES[name]))
    return tmp


def engine_config(model_dir: Path, **overrides: object) -> EngineConfig:
    """The engine settings every GPU benchmark uses (vLLM's offline defaults, where it has them)."""
    settings: dict[str, object] = dict(
        model=str(model_dir),
        device="cuda",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        gpu_memory_utilization=0.9,
    )
    return EngineConfig(**{**settings, **overrides})


def is_mla(cfg: dict) -> bool:
    return "kv_lora_rank" in cfg


def moe_dims(cfg: dict) -> tuple[int, int, int]:
    """(MoE layers, routed experts, experts a token); (0, 0, 0) for a dense model."""
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    if not experts:
        return 0, 0, 0
    dense = cfg.get("first_k_dense_replace", 0) + len(cfg.get("mlp_only_layers", []))
    return cfg["num_hidden_layers"] - dense, experts, cfg["num_experts_per_tok"]


def param_split(cfg: dict) -> tuple[int, int]:
    """(parameters every token reads, parameters of one routed expert): attention, norms, dense
    MLPs, shared experts, routers and embeddings are read every step; each routed expert only
    when a token of the batch chose it."""
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    if is_mla(cfg):
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        rank, rope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        q = (
            h * cfg["q_lora_rank"] + cfg["q_lora_rank"] * heads * qk
            if cfg.get("q_lora_rank")
            else h * heads * qk
        )
        attn = q + h * (rank + rope) + rank * heads * (cfg["qk_nope_head_dim"] + v) + heads * v * h
    else:
        kv, d = cfg["num_key_value_heads"], cfg.get("head_dim", h // heads)
        attn = h * heads * d + 2 * h * kv * d + heads * d * h
    moe_layers, experts, _ = moe_dims(cfg)
    expert = 3 * h * cfg.get("moe_intermediate_size", 0)
    shared = cfg.get("n_shared_experts", 0) * expert + (h * experts if experts else 0)
    dense_mlp = 3 * h * cfg["intermediate_size"]
    mlps = moe_layers * shared + (layers - moe_layers) * dense_mlp
    embed = cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    return layers * (attn + 2 * h) + mlps + embed + h, expert


def param_count(cfg: dict) -> int:
    always, expert = param_split(cfg)
    moe_layers, experts, _ = moe_dims(cfg)
    return always + moe_layers * experts * expert


def weight_bytes_read(cfg: dict, batch: int) -> float:
    """bf16 weight bytes a decode step of `batch` tokens reads: the shared part (not the
    embedding table) and, per MoE layer, the experts hit, E * (1 - (1 - k/E)^batch) in
    expectation under uniform routing."""
    always, expert = param_split(cfg)
    moe_layers, experts, top_k = moe_dims(cfg)
    hit = experts * (1 - (1 - top_k / experts) ** batch) if experts else 0
    # The input embedding is a table lookup (a row a token), not a read of the table: only an
    # untied model's lm_head is read whole besides it.
    lookup = 0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * cfg["hidden_size"]
    return 2 * (always - lookup + moe_layers * hit * expert)


def active_params(cfg: dict) -> int:
    """Parameters one prompt token multiplies (2 flops each): the matmul work of prefill. Not
    the embedding table (a lookup) nor the lm_head (prefill takes logits at one row a sequence);
    attention's own flops are not counted either, so the fraction errs low."""
    always, expert = param_split(cfg)
    moe_layers, _, top_k = moe_dims(cfg)
    tables = cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg["tie_word_embeddings"] else 2)
    return always - tables + moe_layers * top_k * expert


def kv_bytes_per_token(cfg: dict) -> int:
    if is_mla(cfg):
        return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
    d = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * d * 2


def mha_kv_bytes_per_token(cfg: dict) -> int:
    """What plain multi-head attention would cache for an MLA model: per-head K and V."""
    per_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
    return cfg["num_hidden_layers"] * cfg["num_attention_heads"] * per_head * 2


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


class Run:
    """Submit requests to the core and step until all finish, timing every step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.n = 0

    def __call__(self, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        for p in prompts:
            self.n += 1
            self.core.add_request(
                EngineCoreRequest(f"r{self.n}", p, params, [], max_tokens=max_tokens)
            )
        steps: list[tuple[float, float, int, bool, float]] = []
        t0 = time.perf_counter()
        generated = 0
        runner = self.core.runner
        while self.core.has_unfinished_requests():
            s0 = time.perf_counter()
            waited0 = runner.sync_wait_s
            so_decode = (
                all(
                    r.num_computed_tokens >= r.num_prompt_tokens
                    for r in self.core.scheduler.running
                )
                and not self.core.scheduler.waiting
            )
            outs = self.core.step()
            wall_s = time.perf_counter() - s0
            # Exposed host time: the part of the step the GPU's forward pass does not cover.
            exposed_s = wall_s - runner.last_forward_ms / 1e3
            # Host CPU time: the step's wall time less the time the host sat waiting for the GPU.
            busy_s = wall_s - (runner.sync_wait_s - waited0)
            steps.append((wall_s, exposed_s, len(outs), so_decode, busy_s))
            generated += len(outs)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "generated": generated, "steps": steps}


def decode_steps(res: dict) -> list[tuple[float, float, int, bool, float]]:
    return [s for s in res["steps"] if s[3]]


def decode_batch(
    run: Run, b: int, cfg: dict, kvpt: int, bw: float, ctx: int, args: argparse.Namespace
) -> dict[str, float]:
    # At batch 256 the prefill takes 16 steps: requests admitted first must still be decoding
    # when the last is admitted, or no step has the whole batch decoding (seen with 16).
    new = 64 if not args.quick else 32
    res = run(random_prompts(b, ctx, cfg["vocab_size"], b), new)
    ds = [s for s in decode_steps(res) if s[2] == b]
    t = statistics.median(s[0] for s in ds)
    kv_read = b * (ctx + new // 2) * kvpt
    return {
        "context": ctx,
        "tok_s": b / t,
        "step_ms": t * 1e3,
        "host_cpu_share": statistics.median(s[4] for s in ds) / t,
        "host_exposed_share": statistics.median(s[1] for s in ds) / t,
        "roofline_frac": ((weight_bytes_read(cfg, b) + kv_read) / bw) / t,
    }


class MoeLayerCase:
    """One MoE layer's routed experts at a shape's dims (random bf16 weights on the GPU) and,
    per token count, the inputs, the work and its floor: what engine_gpu's MoE rows and
    moe_kernel.py's sweep both time."""

    def __init__(self, cfg: dict) -> None:
        _, self.experts, self.top_k = moe_dims(cfg)
        self.h, self.inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
        self.g = torch.Generator(device="cuda").manual_seed(0)
        e, h, i = self.experts, self.h, self.inter
        self.w13 = torch.randn(e, 2 * i, h, device="cuda", generator=self.g).bfloat16() / h**0.5
        self.w2 = torch.randn(e, h, i, device="cuda", generator=self.g).bfloat16() / i**0.5

    def inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, weights, experts) for t tokens under uniform random routes."""
        x = torch.randn(t, self.h, device="cuda", generator=self.g).bfloat16()
        logits = torch.randn(t, self.experts, device="cuda", generator=self.g)
        weights, chosen = torch.softmax(logits, -1).topk(self.top_k, dim=-1)
        return x, weights, chosen

    def flops(self, t: int) -> float:
        return 6 * t * self.top_k * self.h * self.inter

    def floor_ms(self, t: int, bw: float) -> float:
        """The weights of the experts t tokens hit (in expectation), at copy bandwidth."""
        hit = self.experts * (1 - (1 - self.top_k / self.experts) ** t)
        return hit * 3 * self.h * self.inter * 2 / bw * 1e3

    def dense_bmm_ms(self, t: int) -> float | None:
        """The same work done dense, from a CUDA graph: torch.bmm over [E, T * k / E, H] (every
        expert the same rows: equal flops and weight bytes, no routing) with silu_and_mul
        between. None when there are fewer pairs than experts."""
        from ember.kernels.activation import silu_and_mul

        per = t * self.top_k // self.experts
        if not per:
            return None
        xs = torch.randn(self.experts, per, self.h, device="cuda", generator=self.g).bfloat16()

        def dense() -> torch.Tensor:
            a = torch.bmm(xs, self.w13.transpose(1, 2)).view(-1, 2 * self.inter)
            h = silu_and_mul(a).view(self.experts, per, self.inter)
            return torch.bmm(h, self.w2.transpose(1, 2))

        return graph_ms(dense)


def bench_moe_kernel(cfg: dict, bw: float, peak: float) -> dict[str, dict[str, float]]:
    """One MoE layer's routed experts (fused_moe, routing included) against the same work done
    dense (MoeLayerCase.dense_bmm_ms), both replayed from CUDA graphs as decode steps are."""
    from ember.kernels.fused_moe import fused_moe

    case = MoeLayerCase(cfg)
    out: dict[str, dict[str, float]] = {}
    for t in (1, 64, 256, 2048):
        x, weights, chosen = case.inputs(t)
        fused_ms = graph_ms(lambda x=x, w=weights, e=chosen: fused_moe(x, case.w13, case.w2, w, e))
        row = {"fused_ms": fused_ms, "fused_tflops": case.flops(t) / fused_ms / 1e9}
        row["fused_bw_frac"] = case.floor_ms(t, bw) / fused_ms
        dense_ms = case.dense_bmm_ms(t)
        if dense_ms is not None:
            row["dense_bmm_ms"] = dense_ms
            row["dense_bmm_tflops"] = case.flops(t) / dense_ms / 1e9
            row["fused_vs_dense"] = row["fused_tflops"] / row["dense_bmm_tflops"]
        row["fused_matmul_frac"] = row["fused_tflops"] * 1e12 / peak
        out[str(t)] = row
    return out


def bench_shape(name: str, args: argparse.Namespace, ceil: dict[str, float]) -> dict[str, object]:
    cfg = SHAPES[name]
    weight_bytes = param_count(cfg) * 2
    out: dict[str, object] = {"shape": name, "weight_bytes": weight_bytes}
    bw, peak = ceil["copy_bytes_per_s"], ceil["matmul_flops"]
    if moe_dims(cfg)[1]:
        out["moe_kernel"] = bench_moe_kernel(cfg, bw, peak)
        torch.cuda.empty_cache()
    tmp = shape_dir(name)
    hf_state = None
    if name == "llama" and not args.skip_hf:
        hf_state = bench_hf(tmp, cfg, out, args)
    t0 = time.perf_counter()
    core = EngineCore(engine_config(tmp))
    torch.cuda.synchronize()
    out["startup_s"] = time.perf_counter() - t0
    out["kv_blocks"] = core.num_kv_blocks
    core.runner.gpu_timing = True
    run = Run(core)
    kvpt = kv_bytes_per_token(cfg)
    capacity = core.num_kv_blocks * core.config.block_size
    out["kv_tokens"] = capacity
    if is_mla(cfg):
        out["mha_kv_tokens_same_memory"] = capacity * kvpt // mha_kv_bytes_per_token(cfg)
    vocab = cfg["vocab_size"]
    if hf_state is not None:
        core.runner.model.load_weights(hf_state.items())
        prompt = random_prompts(1, 256, vocab, 7)[0]
        ref = out.pop("hf_logits_ref")
        seen = []
        model = core.runner.model
        orig = model.compute_logits
        model.compute_logits = lambda h: seen.append(orig(h)) or seen[-1]
        core.add_request(EngineCoreRequest("logits", prompt, SamplingParams(max_tokens=1), [], 1))
        while core.has_unfinished_requests():
            core.step()
        del model.compute_logits
        got = seen[0][0].float().cpu()
        out["logits_rel_err_vs_hf_fp32"] = ((got - ref).norm() / ref.norm()).item()
        del hf_state
        gc.collect()

    # decode batch 1: 128 in, 512 out; median of 3 runs of the median step
    b1, b1_host = [], []
    for rep in range(3):
        res = run(random_prompts(1, 128, vocab, rep), 512 if not args.quick else 64)
        b1.append(statistics.median(s[0] for s in decode_steps(res)))
        b1_host.append(statistics.median(s[1] / s[0] for s in decode_steps(res)))
    out["decode_b1_host_share"] = statistics.median(b1_host)
    step = statistics.median(b1)
    gpu_step = step * (1 - out["decode_b1_host_share"])
    # Bytes a batch-1 step reads: the weights it touches (active experts only) and the KV of a
    # context of 128 + 256 tokens on average.
    b1_bytes = weight_bytes_read(cfg, 1) + (128 + 256) * kvpt
    out["decode_b1_bytes"] = b1_bytes
    out["decode_b1_gpu_forward_roofline_frac"] = (b1_bytes / bw) / gpu_step
    out["decode_b1_ms_per_token"] = step * 1e3
    out["decode_b1_tok_s"] = 1 / step
    out["decode_b1_roofline_frac"] = (b1_bytes / bw) / step

    out["decode_batches"] = {}
    for b in (8, 32, 64, 128, 256):
        # 1k of context each, or what the KV pool holds (Qwen3-30B-A3B on an 80 GB card).
        ctx = min(1024, capacity // b - 128)
        out["decode_batches"][b] = decode_batch(run, b, cfg, kvpt, bw, ctx, args)
    out["host_cpu_share_b64"] = out["decode_batches"][64]["host_cpu_share"]

    # The same decodes with async scheduling off, in this run, to show what the overlap buys.
    core.async_scheduling = False
    res = run(random_prompts(1, 128, vocab, 0), 512 if not args.quick else 64)
    out["sync_decode_b1_tok_s"] = 1 / statistics.median(s[0] for s in decode_steps(res))
    out["sync_decode_b64"] = decode_batch(
        run, 64, cfg, kvpt, bw, out["decode_batches"][64]["context"], args
    )
    core.async_scheduling = True

    n_prefill = 64 if not args.quick else 8
    res = run(random_prompts(n_prefill, 2048, vocab, 11), 1)
    tps = n_prefill * 2048 / res["wall_s"]
    out["prefill_tok_s"] = tps
    out["prefill_matmul_frac"] = tps * 2 * active_params(cfg) / peak

    n_mixed = 256 if not args.quick else 32
    mixed_len = min(1024, capacity // n_mixed - 256)
    out["mixed_prompt_len"] = mixed_len
    res = run(random_prompts(n_mixed, mixed_len, vocab, 13), 256 if not args.quick else 32)
    out["mixed_output_tok_s"] = res["generated"] / res["wall_s"]
    out["mixed_wall_s"] = res["wall_s"]
    if "hf_mixed_output_tok_s" in out:
        out["mixed_vs_hf"] = out["mixed_output_tok_s"] / out["hf_mixed_output_tok_s"]
    del core, run
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_hf(path: Path, cfg: dict, out: dict, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """HF transformers eager on the same shape; returns its weights (on the CPU) for ember."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path), dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    vocab = cfg["vocab_size"]
    prompt = random_prompts(1, 256, vocab, 7)[0]
    with torch.no_grad():
        out["hf_logits_ref"] = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
        ids = torch.tensor(random_prompts(1, 128, vocab, 0), device="cuda")
        new = 64
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=1.0,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        out["hf_decode_b1_tok_s"] = new / (time.perf_counter() - t0)
        n, chunk = (256, 64) if not args.quick else (32, 32)
        gen = 256 if not args.quick else 32
        prompts = random_prompts(n, 1024, vocab, 13)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, n, chunk):
            ids = torch.tensor(prompts[i : i + chunk], device="cuda")
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=gen,
                min_new_tokens=gen,
                do_sample=True,
                temperature=1.0,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        out["hf_mixed_output_tok_s"] = n * gen / (time.perf_counter() - t0)
        out["hf_mixed_batch"] = chunk
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    # The noise floor: the same weights in fp32. bf16 HF and bf16 ember are both judged against it.
    hf.float()
    with torch.no_grad():
        ref32 = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
    bf = out["hf_logits_ref"]
    out["hf_logits_ref"] = ref32
    out["hf_bf16_logits_rel_err_vs_fp32"] = ((bf - ref32).norm() / ref32.norm()).item()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return state


UNFUSED = ":unfused"
"""A shape name's suffix: the same shape with the attention backend's fused rotation + KV write
turned off (the separate scatter), the baseline of that fusion in the same run."""


def child(task: str, args: argparse.Namespace) -> dict[str, object]:
    """One task in a process of its own: "ceilings", or a shape's name (+ UNFUSED)."""
    if task == "ceilings":
        return {"gpu": torch.cuda.get_device_name(), "ceilings": ceilings()}
    name = task.removesuffix(UNFUSED)
    if name != task:
        from ember.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.fuses_kv_write = False
    out = bench_shape(name, args, json.loads(args.ceilings))
    out["fused_kv_write"] = name == task
    return out


def run_child(task: str, args: argparse.Namespace, ceil: dict | None) -> dict:
    """Each shape runs in a fresh process, so it gets the whole GPU: in one process the second
    shape's KV pool was sized after the first's leftovers (the caching allocator keeps them)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", task, "--child-out", f.name]
        cmd += ["--ceilings", json.dumps(ceil or {})]
        cmd += ["--skip-hf"] if args.skip_hf else []
        cmd += ["--quick"] if args.quick else []
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="llama,qwen3")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--ceilings", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        out = child(args.child, args)
        Path(args.child_out).write_text(json.dumps(out, default=str))
        return
    first = run_child("ceilings", args, None)
    gpu, ceil = first["gpu"], first["ceilings"]
    results = {"gpu": gpu, "torch": torch.__version__, "ceilings": ceil, "shapes": {}}
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    out = result_path("engine_gpu", gpu, out_dir=out_dir)
    for name in args.shapes.split(","):
        results["shapes"][name] = run_child(name, args, ceil)
        out.write_text(json.dumps(results, indent=2, default=str))
    print(
        f"GPU: {gpu}; copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s; "
        f"bf16 matmul {ceil['matmul_flops'] / 1e12:.0f} TFLOP/s"
    )
    for name, r in results["shapes"].items():
        print(f"\n## {name}  (startup {r['startup_s']:.1f} s, {r['kv_blocks']} KV blocks)")
        print("| metric | value | target |")
        print("|---|---|---|")
        print(
            f"| decode b1 | {r['decode_b1_tok_s']:.1f} tok/s, {r['decode_b1_ms_per_token']:.2f} ms,"
            f" {r['decode_b1_roofline_frac']:.2f} of roofline | >= 0.85 |"
        )
        for b, d in r["decode_batches"].items():
            print(
                f"| decode b{b} (1k ctx) | {d['tok_s']:.0f} tok/s, {d['roofline_frac']:.2f} of "
                f"roofline, host CPU {d['host_cpu_share']:.2f} (exposed "
                f"{d['host_exposed_share']:.2f}) | b128 >= 0.70 |"
            )
        d = r["sync_decode_b64"]
        print(
            f"| async scheduling off | b1 {r['sync_decode_b1_tok_s']:.1f} tok/s, b64 "
            f"{d['tok_s']:.0f} tok/s, host exposed {d['host_exposed_share']:.2f} | |"
        )
        print(
            f"| prefill 64x2048 | {r['prefill_tok_s']:.0f} tok/s, {r['prefill_matmul_frac']:.2f} "
            "of matmul peak | >= 0.85 |"
        )
        print(
            f"| mixed 256x(1024,256) | {r['mixed_output_tok_s']:.0f} output tok/s | >= 0.9x vLLM |"
        )
        if "hf_mixed_output_tok_s" in r:
            print(
                f"| HF eager mixed (batch {r['hf_mixed_batch']}) | {r['hf_mixed_output_tok_s']:.0f} "
                f"tok/s; ember {r['mixed_vs_hf']:.1f}x | >= 10x |"
            )
            print(f"| HF eager decode b1 | {r['hf_decode_b1_tok_s']:.1f} tok/s | |")
            print(
                f"| logits rel err vs HF fp32 | ember bf16 {r['logits_rel_err_vs_hf_fp32']:.2e}, "
                f"HF bf16 {r['hf_bf16_logits_rel_err_vs_fp32']:.2e} | < 1e-2 |"
            )
        print(f"| host CPU share, decode b64 | {r['host_cpu_share_b64']:.2f} | <= 0.20 |")
        print(f"| KV tokens that fit | {r['kv_tokens']} | |")
        if "mha_kv_tokens_same_memory" in r:
            ratio = r["kv_tokens"] / r["mha_kv_tokens_same_memory"]
            print(
                f"| KV tokens, same memory as MHA | {r['mha_kv_tokens_same_memory']} "
                f"(MLA holds {ratio:.1f}x) | |"
            )
        for t, m in r.get("moe_kernel", {}).items():
            dense = (
                f", dense bmm {m['dense_bmm_tflops']:.0f} TFLOP/s, {m['fused_vs_dense']:.2f} of it"
                if "dense_bmm_tflops" in m
                else ""
            )
            print(
                f"| fused MoE, {t} tokens | {m['fused_ms'] * 1e3:.0f} us, "
                f"{m['fused_tflops']:.1f} TFLOP/s, {m['fused_bw_frac']:.2f} of bandwidth{dense} "
                "| b256 >= 0.70 of dense |"
            )
        print(f"| startup | {r['startup_s']:.1f} s | <= 20 s |")


if __name__ == "__main__":
    main()
