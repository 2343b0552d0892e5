"""FP8 decode on one GPU: the CUDA-core block-FP8 GEMV (ember/kernels/fp8_gemv.py) over a grid of
its tiles, against the tensor-core GEMM's 16-row tiles (fp8_gemm.py) and ember's bf16 GEMV, at
Kimi K2's (DeepSeek-V3's) projections with 128 x 128 blocks, W8A8, one row (two at 4 rows); and
the FP8 experts' decode path (fused_moe_decode.moe_fp8_decode) over its tiles against the grouped
GEMM's, at Kimi K2's experts (H 7168, I 2048, 384 experts, top 8) for one and two tokens. Each
case's floor is its weight and scale bytes over the copy bandwidth measured in the run.

Every time is one CUDA graph of calls over rotating weights (dense: copies totalling more than
250 MB; experts: a different top 8 a call), the median of 20 replays, in microseconds a call.
Every variant is first checked against the tensor-core path's output (max error over the
output's largest magnitude; above 2e-2 it is marked wrong and not timed). All variants compile
up front, in parallel (ember/kernels/precompile.py):

    python benchmarks/probes/fp8_decode_sweep.py [--quick] [--budget-s 150]

Prints each case's best tiles and a table, and writes fp8_decode_sweep-<GPU>-<date>.json to $OUT
(or benchmarks/results/). `--quick`: two configs, two shapes (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int_gemv_sweep import copy_bandwidth, graph_us  # noqa: E402
from result_names import result_path  # noqa: E402

from ember.kernels import fp8_gemv  # noqa: E402
from ember.kernels.fp8_gemm import fp8_matmul, tile_config  # noqa: E402
from ember.kernels.fused_moe import fused_moe_fp8, tile_config_fp8  # noqa: E402
from ember.kernels.gemv import gemv  # noqa: E402
from ember.kernels.precompile import precompile  # noqa: E402

DEVICE = "cuda"
BLOCK = (128, 128)
MIN_BYTES = 250e6
TOO_FAR = 2e-2
# name: (N, K) of Kimi K2's FP8 projections.
SHAPES = {
    "q_a": (1536, 7168),
    "q_b": (12288, 1536),
    "kv_a": (576, 7168),
    "o": (7168, 8192),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
}
MORE_ROWS = {"q_a": (4,), "shared_gate_up": (4,)}
SPLIT_SHAPES = ("q_a", "kv_a", "shared_gate_up")
HIDDEN, INTER, EXPERTS, TOP_K = 7168, 2048, 384, 8

# (BLOCK_N, num_warps, chunks a thread a step, num_stages, maxnreg or 0): BLOCK_K = 16 * 32 *
# num_warps * chunks.
GRID = [(bn, w, c, s, 0) for bn in (4, 8) for w in (1, 2, 4) for c in (1, 2) for s in (1, 2)]
GRID += [(8, 2, 1, 1, 128), (8, 4, 1, 1, 128), (16, 2, 1, 1, 128)]
QUICK_GRID = [(8, 2, 1, 1, 0), (4, 4, 1, 1, 0)]
# The experts: (BLOCK_N, num_warps, chunks, SPLIT_TARGET).
MOE_GRID = [(bn, w, c, t) for bn in (8, 16, 32) for w in (1, 2, 4) for c in (1, 2) for t in (16,)]
MOE_GRID += [(16, 2, 1, 0), (16, 2, 1, 32), (8, 4, 1, 0)]
QUICK_MOE_GRID = [(16, 2, 1, 16)]


def tiles(bn: int, warps: int, chunks: int, stages: int, maxnreg: int, split: int = 1) -> dict:
    config = {
        "BLOCK_N": bn,
        "BLOCK_K": 16 * 32 * warps * chunks,
        "SPLIT_K": split,
        "num_warps": warps,
        "num_stages": stages,
    }
    return config | ({"maxnreg": maxnreg} if maxnreg else {})


def label(config: dict) -> str:
    cap = f" r{config['maxnreg']}" if "maxnreg" in config else ""
    split = f" split{config['SPLIT_K']}" if "SPLIT_K" in config else ""
    target = f" t{config['SPLIT_TARGET']}" if "SPLIT_TARGET" in config else ""
    stages = f" s{config['num_stages']}" if "num_stages" in config else ""
    return f"{config['BLOCK_N']}x{config['BLOCK_K']} w{config['num_warps']}{stages}{split}{target}{cap}"


def quantized(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes (no NaN) and block scales around 1e-3."""
    codes = torch.randint(0, 256, (n, k), generator=gen, device=DEVICE, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # 0x7F / 0xFF are NaN
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device=DEVICE) * 1e-3 + 1e-4
    return codes.view(torch.float8_e4m3fn), scale


class Dense:
    """One projection at m rows: rotating FP8 weights beyond L2, x, and the variants to time."""

    def __init__(self, name: str, m: int, grid: list[tuple[int, ...]]):
        self.name, self.m = name, m
        self.n, self.k = n, k = SHAPES[name]
        self.bytes = n * k + 4 * (-(-n // 128)) * (-(-k // 128))
        copies = max(3, math.ceil(MIN_BYTES / self.bytes))
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        self.weights = [quantized(n, k, gen) for _ in range(copies)]
        self.x = torch.randn(m, k, generator=gen, device=DEVICE).bfloat16()
        splits = (1, 2, 4) if name in SPLIT_SHAPES and m == 1 else (1,)
        self.configs = [tiles(*t, split=s) for t in grid for s in splits]

    def call(self, i: int, **kw: object) -> torch.Tensor:
        w, s = self.weights[i]
        return fp8_matmul(self.x, w, s, BLOCK, 128, **kw)

    def calls(self, **kw: object) -> list[Callable[[], object]]:
        return [lambda i=i: self.call(i, **kw) for i in range(len(self.weights))]

    def variants(self) -> list[dict[str, object]]:
        return [{"kernel": "gemm"}, {}] + [{"config": c} for c in self.configs]


class Experts:
    """Kimi K2's FP8 experts at `tokens` tokens: a different top 8 a call."""

    def __init__(self, tokens: int, grid: list[tuple[int, ...]]):
        self.name, self.m = "experts", tokens
        gen = torch.Generator(device=DEVICE).manual_seed(tokens)
        self.w13, self.s13 = quantized(EXPERTS * 2 * INTER, HIDDEN, gen)
        self.w13, self.s13 = (
            self.w13.view(EXPERTS, 2 * INTER, HIDDEN),
            self.s13.view(EXPERTS, 2 * INTER // 128, HIDDEN // 128),
        )
        w2, s2 = quantized(EXPERTS * HIDDEN, INTER, gen)
        self.w2, self.s2 = w2.view(EXPERTS, HIDDEN, INTER), s2.view(EXPERTS, HIDDEN // 128, -1)
        self.x = torch.randn(tokens, HIDDEN, generator=gen, device=DEVICE).bfloat16() * 0.1
        calls = 16
        self.routes = [
            torch.stack(
                [
                    torch.randperm(EXPERTS, device=DEVICE, generator=gen)[:TOP_K]
                    for _ in range(tokens)
                ]
            ).int()
            for _ in range(calls)
        ]
        self.weights = torch.full((tokens, TOP_K), 1.0 / TOP_K, device=DEVICE)
        # Distinct experts over the calls' tokens: the bytes read, a call on average.
        hit = sum(len(set(r.flatten().tolist())) for r in self.routes) / calls
        self.bytes = int(hit * 3 * HIDDEN * INTER * (1 + 4 / 128 / 128))
        self.configs = [
            {"BLOCK_N": bn, "BLOCK_K": 16 * 32 * w * c, "num_warps": w, "SPLIT_TARGET": t}
            for bn, w, c, t in grid
        ]

    def call(self, i: int, **kw: object) -> torch.Tensor:
        args = (self.x, self.w13, self.s13, self.w2, self.s2, self.weights, self.routes[i])
        return fused_moe_fp8(*args, BLOCK, **kw)

    def calls(self, **kw: object) -> list[Callable[[], object]]:
        return [lambda i=i: self.call(i, **kw) for i in range(len(self.routes))]

    def variants(self) -> list[dict[str, object]]:
        tc = tile_config_fp8(self.m * TOP_K, EXPERTS, BLOCK)
        return [{"config": tc}, {}] + [{"config": c} for c in self.configs]


def time_case(case: Dense | Experts, bw: float, bf16_us: float, deadline: float) -> dict:
    first, default, *grid = case.variants()
    ref = case.call(0, **first).float()
    scale = ref.abs().max().item()
    out: dict[str, object] = {
        "shape": case.name,
        "m": case.m,
        "bytes": case.bytes,
        "floor_us": case.bytes / bw * 1e6,
        "bf16_us": bf16_us,
        "configs": {},
    }

    def timed(kw: dict[str, object]) -> dict[str, float | str]:
        err = (case.call(0, **kw).float() - ref).abs().max().item() / scale
        if not err <= TOO_FAR:
            return {"err": err, "wrong": "differs from the tensor-core path"}
        return {"err": err, "us": graph_us(case.calls(**kw))}

    out["tc_default"] = {"us": graph_us(case.calls(**first))}
    out["core_default"] = timed(default)
    for kw in grid:
        name = label(kw["config"])
        if time.perf_counter() > deadline:
            out["configs"][name] = {"skipped": "past the time budget"}
            continue
        try:
            out["configs"][name] = timed(kw)
        except Exception as e:  # a config the GPU refuses (resources): kept, not fatal
            out["configs"][name] = {"error": repr(e)[:200]}
    return out


def ranked(result: dict) -> list[tuple[str, float]]:
    configs = result["configs"]
    return sorted(((k, v["us"]) for k, v in configs.items() if "us" in v), key=lambda kv: kv[1])


def overall(cases: list[dict]) -> list[tuple[str, float]]:
    """Configs timed in every case, by the geometric mean of time over each case's best."""
    ratios: dict[str, list[float]] = {}
    for r in cases:
        best = ranked(r)
        for name, us in best:
            if "split" not in name or "split1" in name:
                ratios.setdefault(name, []).append(us / best[0][1])
    full = [(k, v) for k, v in ratios.items() if len(v) == len(cases)]
    score = [(k, math.exp(sum(map(math.log, v)) / len(v))) for k, v in full]
    return sorted(score, key=lambda kv: kv[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two configs, two shapes")
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args()
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    grid = QUICK_GRID if args.quick else GRID
    names = ("q_a", "o") if args.quick else tuple(SHAPES)
    cases: list[Dense | Experts] = [Dense(name, 1, grid) for name in names]
    cases += [Dense(name, m, grid) for name in names for m in MORE_ROWS.get(name, ())]
    moe_grid = QUICK_MOE_GRID if args.quick else MOE_GRID
    cases += [Experts(t, moe_grid) for t in ((1,) if args.quick else (1, 2))]
    bf16 = {name: torch.randn(*SHAPES[name], device=DEVICE).bfloat16() for name in names}

    def run_dry() -> None:
        for case in cases:
            for kw in case.variants():
                case.call(0, **kw)
        for name in names:
            gemv(torch.randn(1, SHAPES[name][1], device=DEVICE).bfloat16(), bf16[name])

    t0 = time.perf_counter()
    try:
        done = precompile(run_dry, processes=True)
        print(f"compiled {done.variants} variants in {time.perf_counter() - t0:.0f} s")
    except Exception as e:
        print(f"precompile failed ({e!r}); compiling as the cases run")
    # After the compiles: measured first, on a GPU just started, the copy ran at 2.65 TB/s
    # where the kernels then read 4.0 (an H200).
    bw = max(copy_bandwidth() for _ in range(3))
    print(f"{gpu}; copy {bw / 1e9:.0f} GB/s")
    out: dict[str, object] = {
        "gpu": gpu,
        "copy_bytes_per_s": bw,
        "compile_s": time.perf_counter() - t0,
        "tc_tiles_one_row": tile_config(1),
        "core_default": fp8_gemv.core_gemv_config(7168, 7168),
        "cases": [],
    }
    dest = result_path("fp8_decode_sweep", gpu, tag="quick" if args.quick else "")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        bf16_us = math.nan
        if isinstance(case, Dense) and case.m == 1:
            n, k = SHAPES[case.name]
            copies = max(3, math.ceil(MIN_BYTES / (2 * n * k)))
            ws = [bf16[case.name]] + [torch.randn_like(bf16[case.name]) for _ in range(copies - 1)]
            x = case.x
            bf16_us = graph_us([lambda w=w, x=x: gemv(x, w) for w in ws])
            del ws
        result = time_case(case, bw, bf16_us, started + args.budget_s)
        out["cases"].append(result)
        best = ranked(result)
        print(
            f"\n{result['shape']} m={result['m']}: floor {result['floor_us']:.1f} us, bf16 "
            f"{bf16_us:.1f}, tensor cores {result['tc_default']['us']:.1f}, CUDA cores default "
            f"{result['core_default'].get('us', math.nan):.1f}"
        )
        for name, us in best[:5]:
            print(f"    {us:7.1f}  {name}")
        dest.write_text(json.dumps(out, indent=1))
    dense = [r for r in out["cases"] if r["shape"] != "experts" and r["m"] == 1]
    experts = [r for r in out["cases"] if r["shape"] == "experts"]
    for title, group in (("dense one row", dense), ("experts", experts)):
        scores = overall(group)
        out[f"overall_{title.replace(' ', '_')}"] = scores
        top = "; ".join(f"{ratio:.3f} {name}" for name, ratio in scores[:3])
        print(f"\n{title}: time over each case's best (geometric mean): {top}")
    out["seconds"] = time.perf_counter() - started
    dest.write_text(json.dumps(out, indent=1))
    print("\n| case | floor | bf16 | tensor cores | CUDA cores default | best | its tiles |")
    print("|---|---|---|---|---|---|---|")
    for r in out["cases"]:
        best = ranked(r)
        top = best[0] if best else ("-", math.nan)
        print(
            f"| {r['shape']} m{r['m']} | {r['floor_us']:.1f} | {r['bf16_us']:.1f} | "
            f"{r['tc_default']['us']:.1f} | {r['core_default'].get('us', math.nan):.1f} | "
            f"{top[1]:.1f} | {top[0]} |"
        )
    print(f"\ncopy {bw / 1e9:.0f} GB/s; {out['seconds']:.0f} s; wrote {dest}")


if __name__ == "__main__":
    main()
