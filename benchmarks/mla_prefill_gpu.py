"""Prefill of one Kimi K2.5 attention layer (MLA: 64 heads, q LoRA 1536, latent rank 512 + 64
rope, q/k head 192, v head 128, hidden 7168) over fresh prompts of 8k, 32k and 128k tokens, on
one GPU, against the bf16 matmul peak measured in the same run.

A prompt is prefilled as the engine prefills it: steps of `--step-tokens` new tokens (the
engine's token budget), each attending its whole context so far through ember's expanded MLA
prefill (`ember.attention.mla.mla_prefill_expanded`: the latent context expanded to per-head K
and V a chunk of EXPAND_CHUNK tokens at a time, partial results merged by their log-sum-exp).
Timed per prompt, with CUDA events:

- **attention**: the expanded prefill alone (latent gather, expansion, fused attention, merge);
- **layer**: the same plus the layer's projections over the prompt's tokens (q_a, q_b, kv_a,
  o_proj as bf16 matmuls; the MoE FFN that follows is measured by the MoE benchmarks).

FLOPs counted are the useful ones: causal attention 2 x H x (192 + 128) per query-key pair, the
expansion of each step's context (2 x ctx x H x 512 x (128 + 128)), and the projections. The
ratio is achieved FLOP/s over the matmul peak (an 8192^3 bf16 matmul). Also each prompt's peak of
memory the attention allocated beyond its inputs: bounded by the chunk, whatever the context.
A kernel reference: torch's fused attention (cuDNN) on one causal square of `--kernel-len`
tokens at these head dims, the best a single call of it does.

    python benchmarks/mla_prefill_gpu.py [--contexts 8192,32768,131072] [--step-tokens 16384]

Prints a table and writes mla_prefill-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import matmul_flops, median_ms  # noqa: E402
from result_names import result_path  # noqa: E402

from ember.attention.metadata import AttentionMetadata  # noqa: E402
from ember.attention.mla import EXPAND_CHUNK, mla_prefill_expanded  # noqa: E402

HEADS, Q_LORA, RANK, ROPE, NOPE, V, HIDDEN = 64, 1536, 512, 64, 128, 128, 7168
BLOCK = 64


def attention_flops(context: int) -> float:
    pairs = context * (context + 1) / 2
    return 2 * HEADS * (NOPE + ROPE + V) * pairs


def expansion_flops(context: int, step: int) -> float:
    ctxs = range(min(step, context), context + step, step)
    return sum(2 * min(c, context) * HEADS * RANK * (NOPE + V) for c in ctxs)


def projection_flops(tokens: int) -> float:
    per_token = HIDDEN * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + HIDDEN * (RANK + ROPE)
    per_token += HEADS * V * HIDDEN
    return 2 * tokens * per_token


def step_metadata(done: int, new: int, blocks: torch.Tensor) -> AttentionMetadata:
    seq_len = done + new
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, new], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        block_tables=blocks.unsqueeze(0),
        slot_mapping=torch.empty(0, dtype=torch.int64, device="cuda"),
        max_query_len=new,
        max_seq_len=seq_len,
        query_start_loc_cpu=[0, new],
        seq_lens_cpu=[seq_len],
    )


def prompt_ms(context: int, step: int, projections: bool) -> tuple[float, int]:
    """A fresh prompt of `context` tokens prefilled in steps: (ms, peak bytes beyond inputs)."""
    g = torch.Generator(device="cuda").manual_seed(context)
    dt = torch.bfloat16
    nblocks = -(-context // BLOCK)
    cache = torch.randn(nblocks, 1, BLOCK, 1, RANK + ROPE, dtype=dt, device="cuda", generator=g)
    blocks = torch.arange(nblocks, dtype=torch.int32, device="cuda")
    w_uk = torch.randn(HEADS, NOPE, RANK, dtype=dt, device="cuda", generator=g) * RANK**-0.5
    w_uv = torch.randn(HEADS, V, RANK, dtype=dt, device="cuda", generator=g) * RANK**-0.5
    q_nope = torch.randn(step, HEADS, NOPE, dtype=dt, device="cuda", generator=g)
    q_rope = torch.randn(step, HEADS, ROPE, dtype=dt, device="cuda", generator=g)
    out = torch.empty(step, HEADS, V, dtype=dt, device="cuda")
    proj = [
        torch.randn(HIDDEN, Q_LORA, dtype=dt, device="cuda", generator=g),
        torch.randn(Q_LORA, HEADS * (NOPE + ROPE), dtype=dt, device="cuda", generator=g),
        torch.randn(HIDDEN, RANK + ROPE, dtype=dt, device="cuda", generator=g),
        torch.randn(HEADS * V, HIDDEN, dtype=dt, device="cuda", generator=g),
    ]
    x = torch.randn(step, HIDDEN, dtype=dt, device="cuda", generator=g)
    steps = [(d, min(step, context - d)) for d in range(0, context, step)]
    metas = [step_metadata(d, n, blocks[: -(-(d + n) // BLOCK)]) for d, n in steps]
    scale = (NOPE + ROPE) ** -0.5

    def run() -> None:
        for (_, n), meta in zip(steps, metas, strict=True):
            if projections:
                q = (x[:n] @ proj[0]) @ proj[1]
                _ = x[:n] @ proj[2]
                del q
            mla_prefill_expanded(
                q_nope[:n], q_rope[:n], cache, meta, [0], w_uk, w_uv, scale, out[:n]
            )
            if projections:
                _ = out[:n].reshape(n, -1) @ proj[3]

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(run, iters=3 if context > 65536 else 5, warmup=1)
    return ms, torch.cuda.max_memory_allocated() - base


def kernel_ms(length: int) -> float:
    dt = torch.bfloat16
    q = torch.randn(1, HEADS, length, NOPE + ROPE, dtype=dt, device="cuda")
    k = torch.randn_like(q)
    v = torch.randn(1, HEADS, length, V, dtype=dt, device="cuda")
    return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--kernel-len", type=int, default=32768)
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name(0)
    peak = matmul_flops()
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        step = min(args.step_tokens, context)
        attn_ms, attn_mem = prompt_ms(context, step, projections=False)
        layer_ms, _ = prompt_ms(context, step, projections=True)
        attn_flops = attention_flops(context) + expansion_flops(context, step)
        layer_flops = attn_flops + projection_flops(context)
        rows.append(
            {
                "context": context,
                "step_tokens": step,
                "attention_ms": round(attn_ms, 2),
                "layer_ms": round(layer_ms, 2),
                "layer_tokens_per_s": round(context / (layer_ms / 1e3)),
                "attention_tflops": round(attn_flops / (attn_ms / 1e3) / 1e12, 1),
                "layer_tflops": round(layer_flops / (layer_ms / 1e3) / 1e12, 1),
                "attention_of_peak": round(attn_flops / (attn_ms / 1e3) / peak, 3),
                "layer_of_peak": round(layer_flops / (layer_ms / 1e3) / peak, 3),
                "attention_extra_gb": round(attn_mem / 1e9, 2),
            }
        )
        torch.cuda.empty_cache()
    kms = kernel_ms(args.kernel_len)
    kflops = attention_flops(args.kernel_len) / (kms / 1e3)
    print(f"## Kimi K2.5 MLA layer prefill, {gpu}, matmul peak {peak / 1e12:.0f} TFLOP/s")
    print(f"(expanded in chunks of {EXPAND_CHUNK} context tokens)")
    print(
        "| context | step | attention ms | layer ms | layer tok/s | attention TFLOP/s "
        "| of peak | layer TFLOP/s | of peak | attention extra GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['step_tokens']} | {r['attention_ms']} | {r['layer_ms']} "
            f"| {r['layer_tokens_per_s']} | {r['attention_tflops']} | {r['attention_of_peak']} "
            f"| {r['layer_tflops']} | {r['layer_of_peak']} | {r['attention_extra_gb']} |"
        )
    print(
        f"kernel: fused causal attention, {args.kernel_len} tokens square: {kms:.1f} ms, "
        f"{kflops / 1e12:.0f} TFLOP/s, {kflops / peak:.2f} of peak"
    )
    result = {
        "gpu": gpu,
        "matmul_peak_tflops": round(peak / 1e12, 1),
        "expand_chunk": EXPAND_CHUNK,
        "rows": rows,
        "kernel": {
            "length": args.kernel_len,
            "ms": round(kms, 2),
            "tflops": round(kflops / 1e12, 1),
            "of_peak": round(kflops / peak, 3),
        },
    }
    path = result_path("mla_prefill", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
