"""The fused MoE over INT4 experts at decode, on one GPU: the CUDA-core path that fused_moe_int
takes at one and two tokens (ember/kernels/fused_moe_decode.py) over a grid of its tunables,
against bf16 fused_moe and the tensor-core grouped GEMM it replaced there (fused_moe_int with
tile_config_int's tiles), for Moonlight-16B-A3B's routed experts (H 2048, I 1408, 64 experts,
top 6) at 1 and 2 tokens and Kimi K2.5's (H 7168, I 2048, top 8; 64 of its 384 experts
allocated, the routes among them) at 1 token; INT4 in groups of 32 with bf16 scales
(compressed-tensors pack-quantized, symmetric), bf16 activations.

Every time is one CUDA graph of 8 calls, each on another route (the experts it reads mostly
come from HBM, as a model's layers' would), the median of 20 replays, in microseconds a call:
one layer's routed experts. The floor is the bytes of the experts the routes hit (words and
scales) over the copy bandwidth measured in the same run. Each CUDA-core variant's output is
first checked against the tensor-core path's (max error over the output's largest magnitude;
over 2e-2 it is marked wrong, not timed).

Each case sweeps every config of the grid for both projections, then the best one's
SPLIT_TARGET; then, with that for gate/up, every config for the down projection alone
(config["down"]), and the best one's SPLIT_TARGET. All variants compile up front, in parallel
(ember/kernels/precompile.py):

    python benchmarks/probes/moe_int_decode_sweep.py [--quick]

Prints a table per case and writes moe_int_decode_sweep-<GPU>-<date>.json to $OUT (or
benchmarks/results/), rewritten after each case. `--quick`: two configs, Moonlight at 1 token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_names import result_path  # noqa: E402

from benchmarks.probes.int_gemv_sweep import copy_bandwidth, graph_us  # noqa: E402
from ember.kernels import fused_moe_decode  # noqa: E402
from ember.kernels.fused_moe import fused_moe, fused_moe_int, tile_config_int  # noqa: E402
from ember.kernels.fused_moe_decode import decode_config_int  # noqa: E402
from ember.kernels.precompile import precompile  # noqa: E402

DEVICE = "cuda"
BITS, GROUP = 4, 32
ROUTES = 8
TOO_FAR = 2e-2
"""A variant further than this from the tensor-core path (over the output's largest magnitude)
is wrong: bf16 results of the two differ by a few roundings (~1e-2 at most)."""

# name: (hidden, inter, experts allocated, top_k, token counts)
SHAPES = {
    "moonlight": (2048, 1408, 64, 6, (1, 2)),
    "kimi_k2.5": (7168, 2048, 64, 8, (1,)),
}

# (BLOCK_N, BLOCK_K, num_warps, num_stages): a thread's share of a step is BLOCK_N * BLOCK_K /
# (1024 * num_warps) rows of 4 words (32 INT4 values), 2 to 8 here (more rows: fewer instructions
# a weight, fewer programs); BLOCK_K / 4 < 32 * num_warps keeps x's load out of shared memory.
# num_stages > 1 pipelines the loads through shared memory. The default is decode_config_int(4).
GRID = [
    (64, 512, 8, 1),
    (64, 512, 8, 2),
    (64, 256, 4, 1),
    (64, 256, 4, 2),
    (64, 256, 4, 3),
    (32, 256, 4, 1),
    (32, 512, 8, 1),
    (64, 128, 2, 1),
    (128, 128, 4, 1),
    (64, 64, 1, 1),
    (128, 256, 8, 1),
    (128, 256, 4, 1),
    (128, 512, 8, 1),
]
SPLIT_TARGETS = (8, 16, 32)
"""Warps an SM under which K splits, tried with the best tiles of each pass."""
QUICK_GRID = [(64, 512, 8, 1), (64, 256, 4, 2)]


def tiles(t: tuple[int, int, int, int], split_target: int = 16) -> dict[str, Any]:
    block_n, block_k, warps, stages = t
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_warps": warps,
        "num_stages": stages,
        "SPLIT_TARGET": split_target,
    }


def label(config: dict[str, Any]) -> str:
    def one(c: dict[str, Any]) -> str:
        return (
            f"{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']} "
            f"t{c['SPLIT_TARGET']}"
        )

    down = config.get("down")
    up = {k: v for k, v in config.items() if k != "down"}
    return one(up) + (f" | down {one({**up, **down})}" if down else "")


class Case:
    """One expert shape: INT4 and bf16 experts, and ROUTES routes for each token count."""

    def __init__(self, name: str, grid: list[tuple[int, int, int, int]]) -> None:
        self.name = name
        self.hidden, self.inter, self.experts, self.top_k, self.tokens = SHAPES[name]
        h, i, e = self.hidden, self.inter, self.experts
        gen = torch.Generator(device=DEVICE).manual_seed(h + i)

        def words(n: int, k: int) -> torch.Tensor:
            return torch.randint(
                -(2**31), 2**31 - 1, (e, n, k // 8), generator=gen, device=DEVICE, dtype=torch.int32
            )

        def scales(n: int, k: int) -> torch.Tensor:
            # Weights of about 1 / sqrt(k): outputs of about x's size.
            s = torch.rand(e, n, k // GROUP, generator=gen, device=DEVICE) + 0.5
            return (s / (4 * k**0.5)).bfloat16()

        self.w13, self.s13 = words(2 * i, h), scales(2 * i, h)
        self.w2, self.s2 = words(h, i), scales(h, i)
        self.b13 = torch.randn(e, 2 * i, h, generator=gen, device=DEVICE).bfloat16() / h**0.5
        self.b2 = torch.randn(e, h, i, generator=gen, device=DEVICE).bfloat16() / i**0.5
        self.x = torch.randn(max(self.tokens), h, generator=gen, device=DEVICE).bfloat16()
        cpu = torch.Generator().manual_seed(e)  # routes: each token's top_k distinct experts

        def route(t: int) -> torch.Tensor:
            chosen = [torch.randperm(e, generator=cpu)[: self.top_k] for _ in range(t)]
            return torch.stack(chosen).to(DEVICE)

        self.routes = {t: [route(t) for _ in range(ROUTES)] for t in self.tokens}
        self.weights = {
            t: torch.rand(t, self.top_k, generator=cpu).softmax(-1).to(DEVICE) for t in self.tokens
        }
        self.grid = [tiles(c) for c in grid]

    def int4(self, t: int, r: int, config: dict[str, Any] | None) -> torch.Tensor:
        return fused_moe_int(
            self.x[:t],
            self.w13,
            self.s13,
            None,
            self.w2,
            self.s2,
            None,
            self.weights[t],
            self.routes[t][r],
            BITS,
            GROUP,
            config=config,
        )

    def bf16(self, t: int, r: int) -> torch.Tensor:
        return fused_moe(self.x[:t], self.b13, self.b2, self.weights[t], self.routes[t][r])

    def tensor_core(self, t: int) -> dict[str, int]:
        """The tensor-core path's default tiles (its BLOCK_M keeps fused_moe_int on it)."""
        return tile_config_int(t * self.top_k, self.experts, BITS)

    def floor_bytes(self, t: int) -> float:
        """Weight and scale bytes of the experts a call reads, averaged over the routes."""
        per_expert = 3 * self.hidden * self.inter * (BITS / 8 + 2 / GROUP)
        hit = [r.unique().numel() for r in self.routes[t]]
        return per_expert * sum(hit) / len(hit)

    def run_dry(self) -> None:
        # Every variant the timings launch; those of the second pass are the first pass's
        # kernels with other tiles for down: the same variants as the grid's.
        for t in self.tokens:
            self.bf16(t, 0)
            self.int4(t, 0, self.tensor_core(t))
            for config in [None, *self.grid]:
                for s in SPLIT_TARGETS:
                    self.int4(t, 0, {**(config or decode_config_int(BITS)), "SPLIT_TARGET": s})


def time_case(case: Case, t: int, bw: float) -> dict[str, Any]:
    ref = case.int4(t, 0, case.tensor_core(t)).float()
    scale = ref.abs().max().item()
    out: dict[str, Any] = {
        "shape": case.name,
        "tokens": t,
        "hidden": case.hidden,
        "inter": case.inter,
        "top_k": case.top_k,
        "floor_us": case.floor_bytes(t) / bw * 1e6,
        "bf16_us": graph_us([lambda r=r: case.bf16(t, r) for r in range(ROUTES)]),
        "tensor_core": case.tensor_core(t),
        "decode_default": decode_config_int(BITS),
        "configs": {},
    }

    def timed(config: dict[str, Any] | None) -> dict[str, Any]:
        try:
            err = (case.int4(t, 0, config).float() - ref).abs().max().item() / scale
            if not err <= TOO_FAR:
                return {"err": err, "wrong": "differs from the tensor-core path"}
            calls = [lambda r=r: case.int4(t, r, config) for r in range(ROUTES)]
            return {"err": err, "us": graph_us(calls)}
        except Exception as e:  # a config the GPU refuses (resources): kept, not fatal
            return {"error": repr(e)[:200]}

    out["tensor_core_us"] = timed(case.tensor_core(t)).get("us", float("nan"))
    out["decode_default_result"] = timed(None)

    def sweep(configs: list[dict[str, Any]]) -> dict[str, Any]:
        for config in configs:
            out["configs"][label(config)] = {"config": config, **timed(config)}
        done = [out["configs"][label(c)] for c in configs]
        return min((d for d in done if "us" in d), key=lambda d: d["us"])["config"]

    best = sweep(case.grid)
    best = sweep([{**best, "SPLIT_TARGET": s} for s in SPLIT_TARGETS])
    down = sweep([{**best, "down": c} for c in case.grid])["down"]
    best = sweep([{**best, "down": {**down, "SPLIT_TARGET": s}} for s in SPLIT_TARGETS])
    out["best"] = label(best)
    out["best_config"] = best
    out["best_us"] = out["configs"][label(best)]["us"]
    return out


def show(result: dict[str, Any]) -> None:
    ranked = sorted(
        ((k, v["us"]) for k, v in result["configs"].items() if "us" in v), key=lambda kv: kv[1]
    )
    default = result["decode_default_result"].get("us", float("nan"))
    print(
        f"\n## {result['shape']} T={result['tokens']} (H {result['hidden']}, I {result['inter']}, "
        f"top {result['top_k']})\n"
        f"| bf16 fused_moe | INT4 tensor-core default | INT4 CUDA-core default | best | floor |\n"
        f"|---|---|---|---|---|\n"
        f"| {result['bf16_us']:.1f} | {result['tensor_core_us']:.1f} | {default:.1f} | "
        f"{result['best_us']:.1f} | {result['floor_us']:.1f} |"
    )
    for name, us in ranked[:8]:
        print(f"    {us:7.1f}  {name}")
    bad = [k for k, v in result["configs"].items() if "us" not in v]
    if bad:
        print(f"    not timed: {bad}")


def compiled_variants() -> list[dict[str, Any]]:
    """Registers and spills of each compiled variant of the CUDA-core path's GEMV."""
    rows = []
    caches = getattr(fused_moe_decode._moe_gemv_int_kernel, "device_caches", {})  # none interpreted
    for entry in caches.values():
        for kernel in entry[0].values():
            try:
                constants = getattr(kernel.src, "constants", {}) or {}
                rows.append(
                    {
                        "constants": {str(k): v for k, v in constants.items()},
                        "num_warps": kernel.metadata.num_warps,
                        "n_regs": kernel.n_regs,
                        "n_spills": kernel.n_spills,
                    }
                )
            except Exception as e:  # metadata this Triton does not keep
                rows.append({"error": repr(e)[:200]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two configs, Moonlight at T=1")
    args = parser.parse_args()
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{gpu}; copy {bw / 1e9:.0f} GB/s")
    names = ("moonlight",) if args.quick else tuple(SHAPES)
    cases = [Case(name, QUICK_GRID if args.quick else GRID) for name in names]
    if args.quick:
        cases[0].tokens = (1,)

    def run_dry() -> None:
        for case in cases:
            case.run_dry()

    done = precompile(run_dry, processes=True)
    print(f"compiled {done.variants} variants in {done.dry_s + done.compile_s:.0f} s")
    out: dict[str, Any] = {
        "gpu": gpu,
        "copy_bytes_per_s": bw,
        "bits": BITS,
        "group": GROUP,
        "routes": ROUTES,
        "compile_s": done.dry_s + done.compile_s,
        "cases": [],
    }
    dest = result_path("moe_int_decode_sweep", gpu, tag="quick" if args.quick else "")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        for t in case.tokens:
            result = time_case(case, t, bw)
            out["cases"].append(result)
            show(result)
            dest.write_text(json.dumps(out, indent=1))
    out["variants"] = compiled_variants()
    out["seconds"] = time.perf_counter() - started
    dest.write_text(json.dumps(out, indent=1))
    print(f"\n{time.perf_counter() - started:.0f} s; wrote {dest}")


if __name__ == "__main__":
    main()
