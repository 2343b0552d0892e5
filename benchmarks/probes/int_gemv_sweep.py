"""The INT4 decode GEMV's tiles on one GPU: ember's CUDA-core GEMV (ember/kernels/int_gemm.py,
`_core_gemv_kernel`, 1..CORE_MAX_ROWS rows of x) over a grid of its tunables (BLOCK_N, num_warps,
BLOCK_KW, num_stages, SPLIT_K), against ember's bf16 GEMV (ember/kernels/gemv.py; cuBLAS for more
than one row) and the tensor-core INT4 GEMV's default tiles, for Llama-3-8B's projections and a
Moonlight expert at one row (INT4 in groups of 128 and of 32, bf16 x), two of them at 2 and 4 rows;
and the copy bandwidth, for the floor of each case (its weight and scale bytes over it).

Every time is one CUDA graph of calls over rotating weight copies totalling more than 200 MB
(beyond the 50 MB L2, as a model's layers are), the median of 20 replays, in microseconds a call.
Every variant's output is first checked against int_matmul_ref (max error over the output's
largest magnitude, kept in the JSON; above 2e-2 the variant is marked wrong and not timed). All
variants (~95) compile up front, in parallel (ember/kernels/precompile.py); the cases then run
in order of interest (one row in groups of 128, more rows, groups of 32) until --budget-s (135)
has passed, so the run takes about two and a half minutes on an H200:

    python benchmarks/probes/int_gemv_sweep.py [--quick] [--budget-s 135]

Prints the top configs per case, then a summary (the config best over all one-row cases and
over the others, and a table of each case's best), and writes int_gemv_sweep-<GPU>-<date>.json
to $OUT (or benchmarks/results/), rewritten after each case. `--quick`: two tile configs, two
shapes (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from result_names import result_path  # noqa: E402

from ember.kernels import int_gemm  # noqa: E402
from ember.kernels.gemv import gemv  # noqa: E402
from ember.kernels.int_gemm import CHUNK, core_gemv_config, int_matmul  # noqa: E402
from ember.kernels.precompile import precompile  # noqa: E402
from ember.kernels.quant_ref import int_matmul_ref  # noqa: E402

# name: (N, K)
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "expert": (2816, 2048),  # Moonlight-16B-A3B's gate/up of one expert
}
MORE_ROWS = {"qkv": (2, 4), "down": (2, 4)}
"""Shapes also timed at more rows (groups of 128)."""
SPLIT_SHAPES = ("o", "down", "expert")
"""Shapes whose few column tiles may want K split (one row, groups of 128): SPLIT_K 2 and 4 too."""
BITS = 4
DEVICE = "cuda"
MIN_BYTES = 250e6
"""Each case's rotating weight copies total at least this: five times an H200's L2."""
TOO_FAR = 2e-2
"""A variant further than this from int_matmul_ref (over the output's largest magnitude) is wrong
(bf16 outputs are within ~4e-3)."""

# (BLOCK_N, num_warps, chunks a thread a step, num_stages, maxnreg or 0): BLOCK_KW = CHUNK * 32 *
# num_warps * chunks, the layout's words a step (the warps lie along K). The four-row loop sets
# the registers of the kernel (168 a thread at BLOCK_N 8, sm_90 SASS); maxnreg caps them, for
# more programs an SM at one row, at the four-row loop's spills.
GRID = [(bn, w, 1, s, 0) for bn in (4, 8, 16) for w in (1, 2, 4) for s in (1, 2)] + [
    (8, 2, 2, 1, 0),
    (8, 2, 2, 2, 0),
    (8, 2, 1, 3, 0),
    (8, 4, 1, 3, 0),
    (4, 4, 1, 1, 96),
    (8, 2, 1, 1, 128),
    (8, 2, 1, 2, 128),
]
QUICK_GRID = [(8, 2, 1, 2, 0), (4, 4, 1, 1, 96)]


def tiles(
    block_n: int, warps: int, chunks: int, stages: int, maxnreg: int, split: int = 1
) -> dict[str, int]:
    config = {
        "BLOCK_N": block_n,
        "BLOCK_KW": CHUNK.value * 32 * warps * chunks,
        "SPLIT_K": split,
        "num_warps": warps,
        "num_stages": stages,
    }
    return config | ({"maxnreg": maxnreg} if maxnreg else {})


def label(config: dict[str, int]) -> str:
    cap = f" r{config['maxnreg']}" if "maxnreg" in config else ""
    return (
        f"{config['BLOCK_N']}x{config['BLOCK_KW']} w{config['num_warps']} "
        f"s{config['num_stages']} split{config['SPLIT_K']}{cap}"
    )


def graph_us(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median microseconds a call: one CUDA graph holding `calls` back to back, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(calls) * 1e3


def copy_bandwidth() -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write), from a CUDA graph."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = graph_us([lambda: dst.copy_(src)], replays=10)
    return 2 * src.numel() / (us * 1e-6)


class Case:
    """One (shape, rows, group): rotating INT4 weights beyond L2, x, and the calls to time."""

    def __init__(self, name: str, m: int, group: int, grid: list[tuple[int, ...]]):
        self.name, self.m, self.group = name, m, group
        self.n, self.k = n, k = SHAPES[name]
        self.bytes = n * k * BITS // 8 + n * (k // group) * 2  # weights and bf16 scales
        copies = max(3, math.ceil(MIN_BYTES / self.bytes))
        gen = torch.Generator(device=DEVICE).manual_seed(n + k + group)
        words = (n, k * BITS // 32)
        self.packed = [
            torch.randint(-(2**31), 2**31 - 1, words, generator=gen, device=DEVICE).to(torch.int32)
            for _ in range(copies)
        ]
        self.scales = [
            (torch.rand(n, k // group, generator=gen, device=DEVICE) * 0.02 + 0.001).bfloat16()
            for _ in range(copies)
        ]
        self.x = torch.randn(m, k, generator=gen, device=DEVICE).bfloat16()
        splits = (1, 2, 4) if name in SPLIT_SHAPES and m == 1 and group == 128 else (1,)
        # Split K only for BLOCK_N up to 8 (16 makes the fewest column tiles already too few).
        self.configs = [tiles(*t, split=s) for t in grid for s in splits if s == 1 or t[0] <= 8]

    def call(self, i: int, **kw: object) -> torch.Tensor:
        return int_matmul(self.x, self.packed[i], self.scales[i], None, BITS, self.group, **kw)

    def calls(self, **kw: object) -> list[Callable[[], object]]:
        return [lambda i=i: self.call(i, **kw) for i in range(len(self.packed))]

    def variants(self) -> list[dict[str, object]]:
        """The int_matmul keywords of every INT4 variant this case times."""
        return [{"kernel": "tc_gemv"}, {}] + [{"config": c} for c in self.configs]

    def run_dry(self) -> None:
        for kw in self.variants():
            self.call(0, **kw)


def bf16_weights(n: int, k: int) -> list[torch.Tensor]:
    copies = max(3, math.ceil(MIN_BYTES / (n * k * 2)))
    return [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def time_case(case: Case, bw: float, bf16_us: float, deadline: float) -> dict[str, object]:
    """The case's times; configs left when perf_counter() passes `deadline` are not timed."""
    ref = int_matmul_ref(case.x, case.packed[0], case.scales[0], None, BITS, case.group).float()
    scale = ref.abs().max().item()
    out: dict[str, object] = {
        "shape": case.name,
        "n": case.n,
        "k": case.k,
        "m": case.m,
        "group": case.group,
        "bytes": case.bytes,
        "floor_us": case.bytes / bw * 1e6,
        "bf16_us": bf16_us,
        "core_default": core_gemv_config(case.n, case.k, BITS, int_gemm.num_sms(case.x)),
        "configs": {},
    }

    def timed(kw: dict[str, object]) -> dict[str, float | str]:
        err = (case.call(0, **kw).float() - ref).abs().max().item() / scale
        if not err <= TOO_FAR:
            return {"err": err, "wrong": "output differs from int_matmul_ref"}
        return {"err": err, "us": graph_us(case.calls(**kw))}

    out["tc_default"] = timed({"kernel": "tc_gemv"})
    out["core_default_result"] = timed({})
    for config in case.configs:
        if time.perf_counter() > deadline:
            out["configs"][label(config)] = {"skipped": "past the time budget"}
            continue
        try:
            out["configs"][label(config)] = timed({"config": config})
        except Exception as e:  # a config the GPU refuses (resources): kept, not fatal
            out["configs"][label(config)] = {"error": repr(e)[:200]}
    return out


def ranked(result: dict[str, object]) -> list[tuple[str, float]]:
    configs = result["configs"]
    return sorted(((k, v["us"]) for k, v in configs.items() if "us" in v), key=lambda kv: kv[1])


def show(result: dict[str, object]) -> None:
    best = ranked(result)
    tc = result["tc_default"].get("us", math.nan)
    core = result["core_default_result"].get("us", math.nan)
    print(
        f"\n{result['shape']} {result['n']}x{result['k']} m={result['m']} g{result['group']}: "
        f"bf16 {result['bf16_us']:.1f} us, floor {result['floor_us']:.1f}, tensor-core default "
        f"{tc:.1f}, CUDA-core default {core:.1f}"
    )
    for name, us in best[:6]:
        print(f"    {us:7.1f}  {name}")
    why = [next(iter(set(v) - {"err"})) for v in result["configs"].values() if "us" not in v]
    if why:
        print(f"    not timed: {len(why)} ({', '.join(sorted(set(why)))})")


def overall(cases: list[dict[str, object]]) -> list[tuple[str, float]]:
    """Tile configs (SPLIT_K 1) timed in every one of `cases`, by the geometric mean of their time
    over each case's best: one config for them all, best first."""
    ratios: dict[str, list[float]] = {}
    for r in cases:
        best = ranked(r)
        if not best:
            continue
        for name, us in best:
            if name.split()[3] == "split1":
                ratios.setdefault(name, []).append(us / best[0][1])
    full = [(k, v) for k, v in ratios.items() if len(v) == len(cases)]
    score = [(k, math.exp(sum(map(math.log, v)) / len(v))) for k, v in full]
    return sorted(score, key=lambda kv: kv[1])


def compiled_variants() -> list[dict[str, object]]:
    """Registers and spills of each compiled variant of the CUDA-core GEMV."""
    rows = []
    for entry in getattr(int_gemm._core_gemv_kernel, "device_caches", {}).values():
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
    parser.add_argument("--quick", action="store_true", help="two configs, two shapes")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=135.0,
        help="seconds after which no more is timed (the summary still prints)",
    )
    args = parser.parse_args()
    grid = QUICK_GRID if args.quick else GRID
    names = ("o", "expert") if args.quick else tuple(SHAPES)
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{gpu}; copy {bw / 1e9:.0f} GB/s")

    # In order of interest, for a run cut short by the budget.
    cases = [Case(name, 1, 128, grid) for name in names]
    cases += [Case(name, m, 128, grid) for name in names for m in MORE_ROWS.get(name, ())]
    cases += [Case(name, 1, 32, grid) for name in names]
    bf16 = {name: bf16_weights(*SHAPES[name]) for name in names}
    xs = {(case.name, case.m): case.x for case in cases}  # the bf16 GEMV's x

    def bf16_call(name: str, m: int, w: torch.Tensor) -> torch.Tensor:
        x = xs[(name, m)]
        return gemv(x, w) if m == 1 else F.linear(x, w)

    def run_dry() -> None:
        for case in cases:
            case.run_dry()
        for name, m in xs:
            bf16_call(name, m, bf16[name][0])

    t0 = time.perf_counter()
    try:
        done = precompile(run_dry, processes=True)
        print(f"compiled {done.variants} variants in {time.perf_counter() - t0:.0f} s")
    except Exception as e:  # each variant then compiles at its first call, one at a time
        print(f"precompile failed ({e!r}); compiling as the cases run")

    out: dict[str, object] = {
        "gpu": gpu,
        "sms": int_gemm.num_sms(cases[0].x),
        "copy_bytes_per_s": bw,
        "bits": BITS,
        "compile_s": time.perf_counter() - t0,
        "cases": [],
    }
    dest = result_path("int_gemv_sweep", gpu, tag="quick" if args.quick else "")
    dest.parent.mkdir(parents=True, exist_ok=True)
    bf16_us: dict[tuple[str, int], float] = {}
    for case in cases:
        key = (case.name, case.m)
        if key not in bf16_us:
            bf16_us[key] = graph_us(
                [lambda w=w, key=key: bf16_call(*key, w) for w in bf16[case.name]]
            )
        result = time_case(case, bw, bf16_us[key], started + args.budget_s)
        out["cases"].append(result)
        show(result)
        dest.write_text(json.dumps(out, indent=1))
    out["variants"] = compiled_variants()
    out["seconds"] = time.perf_counter() - started
    dest.write_text(json.dumps(out, indent=1))

    # Last, for a log's tail: one config for all cases, then each case's best.
    for title, group in (
        ("one row", [r for r in out["cases"] if r["m"] == 1]),
        ("more rows", [r for r in out["cases"] if r["m"] > 1]),
    ):
        scores = overall(group)
        out[f"overall_{title.replace(' ', '_')}"] = scores
        top = "; ".join(f"{ratio:.3f} {name}" for name, ratio in scores[:3])
        print(f"\n{title}, time over each case's best (geometric mean, {len(group)} cases): {top}")
    dest.write_text(json.dumps(out, indent=1))
    print(
        "\n| case | bf16 | INT4 floor | tensor-core default | CUDA-core default | best | its tiles |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in out["cases"]:
        best = ranked(r)
        top = best[0] if best else ("-", math.nan)
        print(
            f"| {r['shape']} {r['n']}x{r['k']} m{r['m']} g{r['group']} | {r['bf16_us']:.1f} | "
            f"{r['floor_us']:.1f} | {r['tc_default'].get('us', math.nan):.1f} | "
            f"{r['core_default_result'].get('us', math.nan):.1f} | {top[1]:.1f} | {top[0]} |"
        )
    print(f"\ncopy {bw / 1e9:.0f} GB/s; {out['seconds']:.0f} s; wrote {dest}")


if __name__ == "__main__":
    main()
