"""Batch-1 decode's matmuls: ember's one-row GEMV (ember/kernels/gemv.py) against cuBLAS
(F.linear), each weight of the Llama-3-8B shape, inside CUDA graphs over a rotating set of
weights larger than L2 (as 32 layers are), against the copy ceiling of the same run.

Then 32 layers' chain of one-row kernels as a decode step runs them, attention left out:
RMSNorm + residual, q/k/v, o, RMSNorm + residual, gate/up, SiLU-and-mul, down, with each layer's
own weights, in one CUDA graph: cuBLAS for every matmul, the Linear layers' routing, and the GEMV
for every matmul (what a routing rule decides between, with the kernels around the matmuls), and
the layers' routing with SiLU-and-mul in the gate/up GEMV's epilogue (what the MLP runs).

Prints a table and writes JSON to $OUT (or benchmarks/results/), named with the GPU.

Run on a CUDA GPU:

    python benchmarks/probes/gemv.py
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import copy_bandwidth, graph_ms  # noqa: E402

from ember.kernels.activation import silu_and_mul  # noqa: E402
from ember.kernels.gemv import MIN_WEIGHT_ELEMENTS, gemv, gemv_silu, usable  # noqa: E402
from ember.kernels.rmsnorm import rms_norm  # noqa: E402

# name: (N, K, calls a step): the 8B shape's 32 layers and its LM head.
SHAPES = {
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}


# How the chain's matmuls run: cuBLAS for all; as the Linear layers route them, with and without
# SiLU-and-mul in the gate/up GEMV's epilogue (as the MLP runs one row: "+silu"); the GEMV for all.
CHAIN_ROUTES = ("cublas", "routed", "routed+silu", "gemv")


def graph_us(fn: Callable[[], object]) -> float:
    """Microseconds a call, 50 calls back to back in one CUDA graph (engine_gpu.graph_ms)."""
    return graph_ms(fn, chain=50) * 1e3


def one_shape(n: int, k: int) -> dict[str, float]:
    copies = max(2, int(200e6 // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    err = (gemv(x, ws[0]).float() - F.linear(x.float(), ws[0].float())).abs().max().item()
    if err > 5e-2:
        raise AssertionError(f"gemv differs from F.linear by {err} at {(n, k)}")
    turn = [0]

    def weight() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % copies
        return ws[turn[0]]

    return {
        "cublas_us": graph_us(lambda: F.linear(x, weight())),
        "ember_us": graph_us(lambda: gemv(x, weight())),
        "bytes": n * k * 2,
    }


def layer_chain(layers: int = 32) -> dict[str, float]:
    """ms of `layers` layers' one-row kernels (attention left out) in one CUDA graph, for each
    matmul routing; also the bytes their weights hold."""
    h, inter = 4096, 14336
    shapes = {"qkv": (6144, h), "o": (h, h), "gate_up": (2 * inter, h), "down": (h, inter)}
    ws = [
        {
            name: torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            for name, (n, k) in shapes.items()
        }
        for _ in range(layers)
    ]
    norm = torch.ones(h, dtype=torch.bfloat16, device="cuda")
    x0 = torch.randn(1, h, dtype=torch.bfloat16, device="cuda")

    def matmul(route: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # "routed": the Linear layers' own rule (gemv.usable), whatever it is now.
            gemv_here = route == "gemv" or (route == "routed" and usable(x, w, None))
            return gemv(x, w) if gemv_here else F.linear(x, w)

        return run

    def step(route: str) -> Callable[[], object]:
        mm = matmul(route.removesuffix("+silu"))

        def activated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            if route.endswith("+silu"):  # SiLU-and-mul in the GEMV's epilogue
                return gemv_silu(x, w)
            return silu_and_mul(mm(x, w))

        def run() -> object:
            x, residual = x0, x0.clone()
            for w in ws:
                x, residual = rms_norm(x, norm, 1e-5, residual)
                x = mm(mm(x, w["qkv"])[:, :h], w["o"])
                x, residual = rms_norm(x, norm, 1e-5, residual)
                x = mm(activated(x, w["gate_up"]), w["down"])
            return x

        return run

    out: dict[str, float] = {"bytes": sum(w.numel() * 2 for layer in ws for w in layer.values())}
    for route in CHAIN_ROUTES:
        out[f"{route}_ms"] = graph_ms(step(route), iters=20)
    return out


def main() -> None:
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    rows = {name: one_shape(n, k) for name, (n, k, _) in SHAPES.items()}
    step = {
        lib: sum(rows[name][f"{lib}_us"] * calls for name, (_, _, calls) in SHAPES.items())
        for lib in ("cublas", "ember")
    }
    # What the Linear layers do: the GEMV for weights above MIN_WEIGHT_ELEMENTS, cuBLAS below.
    step["routed"] = sum(
        rows[name]["ember_us" if n * k > MIN_WEIGHT_ELEMENTS else "cublas_us"] * calls
        for name, (n, k, calls) in SHAPES.items()
    )
    chain = layer_chain()
    out = {
        "gpu": gpu,
        "copy_bytes_per_s": bw,
        "rows": rows,
        "step_matmul_us": step,
        "layer_chain": chain,
    }
    print(f"{gpu}; copy {bw / 1e9:.0f} GB/s\n")
    print("| weight (1 row) | cuBLAS us | ember GEMV us | copy floor us |\n|---|---|---|---|")
    for name, r in rows.items():
        floor = r["bytes"] / bw * 1e6
        print(f"| {name} | {r['cublas_us']:.1f} | {r['ember_us']:.1f} | {floor:.1f} |")
    print(f"| a step's matmuls (32 layers + head) | {step['cublas']:.0f} | {step['ember']:.0f} | |")
    print(f"| the same as the layers route them | | {step['routed']:.0f} | |")
    floor = chain["bytes"] / bw * 1e3
    print(
        f"\n32 layers' one-row kernels (no attention), one CUDA graph (copy floor {floor:.3f} ms):"
        "\n| matmuls | ms |\n|---|---|"
    )
    for route in CHAIN_ROUTES:
        print(f"| {route} | {chain[f'{route}_ms']:.3f} |")
    dest = Path(os.environ.get("OUT") or "benchmarks/results")
    (dest / f"gemv-{gpu.replace(' ', '_')}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
