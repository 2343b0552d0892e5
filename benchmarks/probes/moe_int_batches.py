"""INT4 experts against bf16 experts by batch on one GPU: `fused_moe_int` (Kimi K2.5's INT4, group
32) and `fused_moe` (bf16) at Moonlight-16B-A3B's expert dims (64 experts, top 6, H 2048, I 1408),
random routes, for 1 to 1,024 tokens; each against its bytes over the copy rate measured in the
run (the experts the routes hit, read once). Where INT4 stops gaining on bf16 as the batch grows
is where its tensor-core tiles are bound by dequantizing, not by bytes.

INT4 runs each batch from 16 tokens on other ways besides its default tiles: the general unpacking
(`INT4_PAIRS` 0: fields one at a time in fp32, as before two weights an instruction), and the
pairs on mma.sync tiles of 32 rows and wgmma tiles of 64 and 128 rows (named m<rows>_n<cols>_
k<depth>_w<warps>), to choose `tile_config_int`'s tiles by.

Every time is one CUDA graph of calls over two weight copies (beyond L2) and 8 route sets, the
median of 20 replays, in microseconds a call:

    python benchmarks/probes/moe_int_batches.py

Prints a table and writes moe_int_batches-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int_gemv_sweep import graph_us  # noqa: E402
from result_names import result_path  # noqa: E402

from ember.kernels.fused_moe import fused_moe, fused_moe_int, tile_config_int  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER, GROUP = 64, 6, 2048, 1408, 32
TOKENS = (1, 16, 64, 256, 1024)
COPIES, ROUTES = 2, 8
VARIANTS = {
    "general_unpack": {"INT4_PAIRS": 0},
    "m32_n64_k128_w4": {
        "BLOCK_M": 32,
        "BLOCK_N": 64,
        "BLOCK_K": 128,
        "num_warps": 4,
        "num_stages": 3,
    },
    "m64_n64_k64_w4": {
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "BLOCK_K": 64,
        "num_warps": 4,
        "num_stages": 4,
    },
    "m64_n64_k128_w4": {
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "BLOCK_K": 128,
        "num_warps": 4,
        "num_stages": 3,
    },
    "m64_n64_k128_w8": {
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "BLOCK_K": 128,
        "num_warps": 8,
        "num_stages": 3,
    },
    "m64_n128_k64_w8": {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "BLOCK_K": 64,
        "num_warps": 8,
        "num_stages": 3,
    },
    "m128_n128_k64_w8": {
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 64,
        "num_warps": 8,
        "num_stages": 3,
    },
}


def copy_bandwidth() -> float:
    """Bytes a second of a 1 GiB bf16 device-to-device copy (read + write), the best of three."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return max(
        2 * src.numel() * 2 / (graph_us([lambda: dst.copy_(src)], 10) * 1e-6) for _ in range(3)
    )


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    gpu = torch.cuda.get_device_name()

    def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        words = torch.randint(-(2**31), 2**31, (EXPERTS, n, k // 8), generator=gen, device="cuda")
        scale = torch.full((EXPERTS, n, k // GROUP), 0.004, device="cuda", dtype=torch.bfloat16)
        return words.to(torch.int32), scale

    int4 = [(*packed(2 * INTER, HIDDEN), *packed(HIDDEN, INTER)) for _ in range(COPIES)]
    bf16 = [
        (
            torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda").bfloat16() * 0.02,
            torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda").bfloat16() * 0.02,
        )
        for _ in range(COPIES)
    ]
    rows = []
    for t in TOKENS:
        x = torch.randn(t, HIDDEN, generator=gen, device="cuda").bfloat16()
        weights = torch.full((t, TOP_K), 1.0 / TOP_K, device="cuda")
        routes = [
            torch.stack(
                [torch.randperm(EXPERTS, generator=gen, device="cuda")[:TOP_K] for _ in range(t)]
            ).int()
            for _ in range(ROUTES)
        ]
        hit = sum(len(set(r.flatten().tolist())) for r in routes) / ROUTES
        weights_per_expert = 3 * HIDDEN * INTER
        int4_bytes = hit * weights_per_expert * (0.5 + 2 / GROUP)
        bf16_bytes = hit * weights_per_expert * 2

        def int4_call(i: int, config=None, x=x, weights=weights, routes=routes) -> torch.Tensor:
            p13, s13, p2, s2 = int4[i % COPIES]
            return fused_moe_int(
                x, p13, s13, None, p2, s2, None, weights, routes[i], 4, GROUP, config
            )

        def bf16_call(i: int, x=x, weights=weights, routes=routes) -> torch.Tensor:
            w13, w2 = bf16[i % COPIES]
            return fused_moe(x, w13, w2, weights, routes[i])

        int4_us = graph_us([lambda i=i: int4_call(i) for i in range(ROUTES)])
        bf16_us = graph_us([lambda i=i: bf16_call(i) for i in range(ROUTES)])
        variants = {}
        if t >= 16:
            base = tile_config_int(t * TOP_K, EXPERTS, 4)
            for name, change in VARIANTS.items():
                config = {**base, **change}
                calls = [lambda i=i, c=config: int4_call(i, c) for i in range(ROUTES)]
                variants[name] = graph_us(calls)
        row = {
            "tokens": t,
            "experts_hit": hit,
            "int4_us": int4_us,
            "int4_bytes": int4_bytes,
            "bf16_us": bf16_us,
            "bf16_bytes": bf16_bytes,
            "flops": 6 * t * TOP_K * HIDDEN * INTER,
            "int4_variants_us": variants,
        }
        rows.append(row)
        print(
            f"{t:5d} tokens, {hit:4.1f} experts: INT4 {int4_us:7.1f} us ({int4_bytes / 1e6:.0f} MB), "
            f"bf16 {bf16_us:7.1f} ({bf16_bytes / 1e6:.0f} MB), "
            f"INT4 {bf16_us / int4_us:.2f}x faster; "
            + ", ".join(f"{k} {v:.1f}" for k, v in variants.items())
        )
    # Measured last, the kernels compiled and the GPU warm (first, it read ~2.7 TB/s on an H200).
    bw = copy_bandwidth()
    for row in rows:
        row["int4_floor_us"] = row["int4_bytes"] / bw * 1e6
        row["bf16_floor_us"] = row["bf16_bytes"] / bw * 1e6
    out = {"gpu": gpu, "copy_bytes_per_s": bw, "rows": rows}
    dest = result_path("moe_int_batches", gpu)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(f"copy {bw / 1e9:.0f} GB/s; wrote {dest}")


if __name__ == "__main__":
    main()
