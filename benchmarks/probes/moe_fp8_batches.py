"""FP8 block experts by batch on one GPU: `fused_moe_fp8` at Kimi K2's expert dims (384 experts,
top 8, H 7168, I 2048, 128 x 128 blocks), random routes, for 1 to 1,024 tokens, each against
its bytes over the copy rate measured in the run (the experts the routes hit, read once), and
beside vLLM's Triton fused MoE on the same dims and routes (its own tiles; run in a child
process with $VLLM_SITE on its path, when that is set: scripts/vllm_device_env.sh).

Each batch from 16 tokens also runs other tiles besides the default ones (named m<rows>_n<cols>
_w<warps>_s<stages>, then `swap` where each dot is W x^T: the few rows an expert as the MMA's
narrow side, an fp8 wgmma on sm_90 where 16-row x W^T tiles are fp16 mma.sync with the weights
unpacked; `q0` where the activations are quantized by a launch of their own before each GEMM),
to choose `tile_config_fp8`'s tiles by.

Every time is one CUDA graph of calls over two weight copies (beyond L2) and 8 route sets, the
median of 20 replays, in microseconds a call:

    python benchmarks/probes/moe_fp8_batches.py

Prints a table and writes moe_fp8_batches-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int_gemv_sweep import copy_bandwidth, graph_us  # noqa: E402
from result_names import result_path  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER, BLOCK = 384, 8, 7168, 2048, 128
TOKENS = (1, 16, 64, 128, 256, 1024)
COPIES, ROUTES = 2, 8


def _tiles(m: int, n: int, warps: int, stages: int, swap: int, quant_a: int) -> dict[str, int]:
    return {
        "BLOCK_M": m,
        "BLOCK_N": n,
        "BLOCK_K": BLOCK,
        "num_warps": warps,
        "num_stages": stages,
        "SWAP_AB": swap,
        "QUANT_A": quant_a,
    }


VARIANTS = {
    "m16_n128_w4_s3_q0": _tiles(16, 128, 4, 3, 0, 0),
    "m16_n128_w4_s4": _tiles(16, 128, 4, 4, 0, 1),
    "m16_n128_w4_s3_swap_q0": _tiles(16, 128, 4, 3, 1, 0),
    "m16_n128_w4_s4_swap_q0": _tiles(16, 128, 4, 4, 1, 0),
    "m16_n128_w4_s4_swap": _tiles(16, 128, 4, 4, 1, 1),
    "m16_n64_w4_s4_swap_q0": _tiles(16, 64, 4, 4, 1, 0),
    "m32_n128_w4_s3_swap_q0": _tiles(32, 128, 4, 3, 1, 0),
    "m64_n128_w8_s4_q0": _tiles(64, 128, 8, 4, 0, 0),
    "m64_n128_w4_s3_q0": _tiles(64, 128, 4, 3, 0, 0),
}


def _weights(gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    def fp8(e: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Finite e4m3 bytes (|bits| < 120 leaves out the NaN codes), a scale a 128 x 128 block.
        bits = torch.randint(-119, 120, (e, n, k), generator=gen, device="cuda", dtype=torch.int8)
        scale = torch.full((e, n // BLOCK, k // BLOCK), 1e-3, device="cuda")
        return bits.view(torch.float8_e4m3fn), scale

    return [(*fp8(EXPERTS, 2 * INTER, HIDDEN), *fp8(EXPERTS, HIDDEN, INTER)) for _ in range(COPIES)]


def _routes(gen: torch.Generator, t: int) -> list[torch.Tensor]:
    return [
        torch.stack(
            [torch.randperm(EXPERTS, generator=gen, device="cuda")[:TOP_K] for _ in range(t)]
        ).int()
        for _ in range(ROUTES)
    ]


def vllm_child(path: str) -> None:
    """In a process with vLLM importable: time its fused_experts (fp8 w8a8, 128 x 128 blocks, its
    default tiles for these dims) on the routes saved at `path`; the times written back there."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    saved = torch.load(path)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = _weights(gen)
    times = {}
    for t, routes in saved["routes"].items():
        x = torch.randn(t, HIDDEN, generator=gen, device="cuda").bfloat16()
        weights = torch.full((t, TOP_K), 1.0 / TOP_K, device="cuda")
        routes = [r.cuda() for r in routes]

        def call(i: int, x=x, weights=weights, routes=routes) -> torch.Tensor:
            w13, s13, w2, s2 = copies[i % COPIES]
            quant = fp8_w8a8_moe_quant_config(s13, s2, block_shape=[BLOCK, BLOCK])
            return fused_experts(x, w13, w2, weights, routes[i], quant_config=quant)

        times[t] = graph_us([lambda i=i: call(i) for i in range(ROUTES)])
        print(f"vllm {t} tokens: {times[t]:.1f} us", flush=True)
    torch.save({"times": times}, path)


def vllm_times(routes: dict[int, list[torch.Tensor]]) -> dict[int, float] | str:
    """vLLM's us a call by token count, or why there are none."""
    site = os.environ.get("VLLM_SITE")
    if not site:
        return "VLLM_SITE not set"
    path = Path(os.environ.get("OUT", "/tmp")) / "moe_fp8_batches_vllm.pt"
    torch.save({"routes": {t: [r.cpu() for r in rs] for t, rs in routes.items()}}, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, __file__, "--vllm-child", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        if run.returncode != 0:
            return f"vLLM child exited {run.returncode}: {run.stderr[-2000:]}"
        return torch.load(path)["times"]
    finally:
        path.unlink(missing_ok=True)


def main() -> None:
    from ember.kernels.fused_moe import fused_moe_fp8, tile_config_fp8

    gen = torch.Generator(device="cuda").manual_seed(0)
    gpu = torch.cuda.get_device_name()
    copies = _weights(gen)
    block = (BLOCK, BLOCK)
    per_expert_bytes = 3 * HIDDEN * INTER * (1 + 4 / BLOCK**2)
    rows, all_routes = [], {}
    for t in TOKENS:
        x = torch.randn(t, HIDDEN, generator=gen, device="cuda").bfloat16()
        weights = torch.full((t, TOP_K), 1.0 / TOP_K, device="cuda")
        routes = all_routes[t] = _routes(gen, t)
        hit = sum(len(set(r.flatten().tolist())) for r in routes) / ROUTES

        def call(i: int, config=None, x=x, weights=weights, routes=routes) -> torch.Tensor:
            w13, s13, w2, s2 = copies[i % COPIES]
            return fused_moe_fp8(x, w13, s13, w2, s2, weights, routes[i], block, config=config)

        default_us = graph_us([lambda i=i: call(i) for i in range(ROUTES)])
        variants = {}
        if t >= 16:
            for name, config in VARIANTS.items():
                calls = [lambda i=i, c=config: call(i, dict(c)) for i in range(ROUTES)]
                try:
                    variants[name] = graph_us(calls)
                except Exception as exc:  # a tile that does not compile is a result, not a stop
                    variants[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row = {
            "tokens": t,
            "experts_hit": hit,
            "bytes": hit * per_expert_bytes,
            "default_tiles": tile_config_fp8(t * TOP_K, EXPERTS, block) if t > 2 else "decode",
            "default_us": default_us,
            "variants_us": variants,
        }
        rows.append(row)
        best = min(
            ((k, v) for k, v in variants.items() if isinstance(v, float)),
            key=lambda kv: kv[1],
            default=("-", float("nan")),
        )
        print(
            f"{t:5d} tokens, {hit:5.1f} experts ({hit * per_expert_bytes / 1e9:.2f} GB): "
            f"default {default_us:8.1f} us, best {best[0]} {best[1]:.1f}",
            flush=True,
        )
    copies.clear()  # the weights freed for the vLLM child
    torch.cuda.empty_cache()
    vllm = vllm_times(all_routes)
    if isinstance(vllm, str):
        print(vllm)
    # Measured last, the kernels compiled and the GPU warm.
    bw = copy_bandwidth()
    print(f"\ncopy {bw / 1e9:.0f} GB/s\n")
    print("| tokens | experts hit | floor us | ember us | GB/s | best variant | us | vLLM us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        row["floor_us"] = row["bytes"] / bw * 1e6
        row["vllm_us"] = vllm.get(row["tokens"]) if isinstance(vllm, dict) else None
        timed = {k: v for k, v in row["variants_us"].items() if isinstance(v, float)}
        name = min(timed, key=timed.__getitem__) if timed else "-"
        print(
            f"| {row['tokens']} | {row['experts_hit']:.1f} | {row['floor_us']:.0f} "
            f"| {row['default_us']:.0f} | {row['bytes'] / row['default_us'] / 1e3:.0f} | {name} "
            f"| {timed.get(name, float('nan')):.0f} "
            f"| {row['vllm_us'] or float('nan'):.0f} |"
        )
    out = {
        "gpu": gpu,
        "copy_bytes_per_s": bw,
        "dims": {"experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inter": INTER},
        "variants": VARIANTS,
        "vllm": vllm if isinstance(vllm, str) else "vllm fused_experts, its default tiles",
        "rows": rows,
    }
    dest = result_path("moe_fp8_batches", gpu)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-child":
        vllm_child(sys.argv[2])
    else:
        main()
