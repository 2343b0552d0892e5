"""Decode attention at the mixed load's decode phase against the card's read bandwidth, and the
engine's kernel under other tile and pipeline settings.

The mixed load's decode phase (256 x (1024 in, 256 out)) spends ~60% of each step in decode
attention: 256 rows over ~1,152 tokens of context each, 8 KV heads of 128 on the Llama-3-8B
shape, pages of 64. Every setting is timed as the engine's CUDA graphs run it: one call per layer,
32 layers (each on its own cache, 38.7 GB in all at 1,152 tokens, so nothing stays in L2)
captured back to back, median per call. Against:

- copy: `y.copy_(x)` over 1 GiB (bytes read + written), as the other benchmarks' ceiling;
- read: a Triton kernel that only reads (a sum over 4 GiB), the ceiling of a kernel that reads
  K and V and writes almost nothing.

Each setting's output is checked against the default's (and the default's against a PyTorch
reference on a few rows) before it is timed. Prints tables, writes JSON to $OUT (or
benchmarks/results/), named with the GPU.

    python benchmarks/probes/decode_attention_sweep.py [--quick]
    python benchmarks/probes/decode_attention_sweep.py --splits
    python benchmarks/probes/decode_attention_sweep.py --layouts [--all-layouts]
    python benchmarks/probes/decode_attention_sweep.py --interleaved [--long]

`--splits`: the engine's default setting at each split count over batch sizes and contexts, the
fastest count against the one `choose_num_splits` gives (at its default programs per SM and
others), to tune that rule. `--layouts`: four settings on the engine's cache layout (one tensor,
a block holding a page of every layer) against separate tensors a layer. `--interleaved`: four
settings between the layer's matmuls, as a decode step runs them (the isolated sweep's ranking
was not the engine's: docs/performance.md).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import copy_bandwidth, median_ms  # noqa: E402

import ember.kernels.decode_attention as da  # noqa: E402
from ember.kernels.decode_attention import choose_num_splits, decode_attention  # noqa: E402
from ember.kernels.dispatch import num_sms  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 32, 8, 128, 64, 32
BEFORE = {"block_n": 64, "num_warps": 4, "num_stages": 2, "head_major": False}
"""The kernel's earlier setting, the baseline each table compares against."""
FOUR = [
    {"block_n": 64, "num_warps": 4, "num_stages": stages, "head_major": head_major}
    for head_major in (False, True)
    for stages in (2, 3)
]
"""2 or 3 stages, in row order or head-major: the `--layouts` and `--interleaved` settings."""


@contextlib.contextmanager
def setting(cfg: dict):
    """Within: the decode attention kernel's module settings (NUM_WARPS, NUM_STAGES,
    HEAD_MAJOR, BLOCK_N) as `cfg` names them, lowercase; the module's own outside."""
    saved = {key: getattr(da, key.upper()) for key in cfg}
    for key, value in cfg.items():
        setattr(da, key.upper(), value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(da, key.upper(), value)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_bandwidth() -> dict[str, float]:
    """Bytes read per second by a read-only kernel, best over a few grid sizes."""
    x = torch.randn((4 << 30) // 2, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best: dict[str, float] = {}
    for per_sm in (2, 4, 8, 16):
        for block in (2048, 4096, 8192):
            grid = sms * per_sm
            out = torch.empty(grid, dtype=torch.float32, device="cuda")
            ms = median_ms(
                lambda g=grid, o=out, b=block: _read_kernel[(g,)](x, o, x.numel(), BLOCK=b)
            )
            rate = x.numel() * 2 / (ms / 1e3)
            if rate > best.get("bytes_per_s", 0.0):
                best = {"bytes_per_s": rate, "programs_per_sm": per_sm, "block": block}
    ref = x.float().sum().item()
    got = out.sum().item()
    if abs(got - ref) > 1e-3 * max(1.0, abs(ref)) + 100:
        raise AssertionError(f"read kernel sums {got}, torch {ref}")
    return best


def layers_for(batch: int, ctx: int) -> int:
    """Layers of cache to cycle through: 32, or fewer where they would pass ~8 GB (two at
    least, each far larger than L2 there)."""
    per_layer = batch * ctx * HKV * D * 2 * 2
    return max(2, min(LAYERS, (8 << 30) // per_layer))


def paged_layer(batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = -(-ctx // PAGE)
    cache = torch.randn(batch * pages, 2, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    return cache, table


def reference(q, cache, table, lens, rows: list[int]) -> torch.Tensor:
    outs = []
    for b in rows:
        n = int(lens[b])
        pages = table[b, : -(-n // PAGE)].long()
        kv = cache[pages]  # [p, 2, PAGE, HKV, D]
        k = kv[:, 0].reshape(-1, HKV, D)[:n].float()
        v = kv[:, 1].reshape(-1, HKV, D)[:n].float()
        k = k.repeat_interleave(HQ // HKV, dim=1)
        v = v.repeat_interleave(HQ // HKV, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) * D**-0.5
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(outs)


def run(q, layers, lens, splits: int, cfg: dict, out: torch.Tensor) -> None:
    with setting(cfg):
        for cache, table in layers:
            decode_attention(q, cache, lens, table, D**-0.5, out=out, num_splits=splits)


def graph_us(q, layers, lens, splits: int, cfg: dict) -> float:
    out = torch.empty_like(q)
    run(q, layers, lens, splits, cfg, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(q, layers, lens, splits, cfg, out)
    return median_ms(graph.replay, iters=10, warmup=2) * 1e3 / len(layers)


def engine_layers(batch: int, ctx: int, order: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The engine's cache: one tensor [blocks, layers, 2, page, Hkv, D] (a block holds a page of
    every layer), a layer's view `cache[:, layer]`; each row's pages in allocation order
    ("seq": row after row, as a prefill allocates) or shuffled ("perm")."""
    pages = -(-ctx // PAGE)
    cache = torch.randn(batch * pages, LAYERS, 2, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    ids = torch.arange(batch * pages, device="cuda")
    if order == "perm":
        ids = ids[torch.randperm(batch * pages, device="cuda")]
    table = ids.to(torch.int32).view(batch, pages)
    return [(cache[:, layer], table) for layer in range(LAYERS)]


def make_layers(batch: int, ctx: int, layout: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if layout == "separate":
        return [paged_layer(batch, ctx) for _ in range(LAYERS)]
    return engine_layers(batch, ctx, layout.removeprefix("engine-"))


def case(
    batch: int,
    ctx: int,
    configs: list[dict],
    split_list: list[int],
    read_bps: float,
    layout: str = "separate",
    lens_dtype: torch.dtype = torch.int32,
):
    layers = make_layers(batch, ctx, layout)
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), ctx, dtype=lens_dtype, device="cuda")
    nbytes = batch * ctx * HKV * D * 2 * 2
    base = torch.empty_like(q)
    run(q, layers[:1], lens, 1, {}, base)
    rows = sorted({0, batch // 2, batch - 1})
    ref = reference(q, *layers[0], lens, rows)
    err = (base[rows].float() - ref).abs().max().item()
    if err > 2e-2:
        raise AssertionError(f"default kernel off the reference by {err} at b{batch} x {ctx}")
    results = []
    auto = choose_num_splits(batch, HKV, ctx, num_sms(q))
    for splits in split_list:
        for cfg in configs:
            got = torch.empty_like(q)
            try:
                run(q, layers[:1], lens, splits, cfg, got)
                torch.cuda.synchronize()
            except Exception as exc:  # a setting the card cannot run (shared memory): recorded
                results.append({"splits": splits, **cfg, "error": type(exc).__name__})
                continue
            diff = (got.float() - base.float()).abs().max().item()
            if diff > 2e-2:
                raise AssertionError(f"{cfg} splits {splits} differs by {diff}")
            us = graph_us(q, layers, lens, splits, cfg)
            results.append(
                {
                    "splits": splits,
                    **cfg,
                    "us": us,
                    "gb_s": nbytes / us / 1e3,
                    "of_read": nbytes / (us / 1e6) / read_bps,
                }
            )
    del layers
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "ctx": ctx,
        "layout": layout,
        "lens_dtype": str(lens_dtype),
        "auto_splits": auto,
        "ref_err": err,
        "rows": results,
    }


def interleaved_rows(read_bps: float) -> list[dict]:
    """Settings timed between the layer's matmuls, as a decode step runs them: per layer the
    qkv, o, gate/up and down GEMMs at M = 256 (the 8B shape's weights, 14 GB in all) with the
    attention call after qkv, 32 layers in one graph; the attention's share is the graph's time
    less that of the same graph without it. The settings' order here against the isolated
    sweep's tells whether the isolated sweep predicts a decode step."""
    batch, ctx, hidden, inter = 256, 1152, 4096, 14336
    layers = engine_layers(batch, ctx, "seq")
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
    h = torch.randn(batch, inter, dtype=torch.bfloat16, device="cuda")
    weights = [
        [
            torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            for n, k in ((6144, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter))
        ]
        for _ in range(LAYERS)
    ]

    def step(cfg: dict | None) -> None:
        for (cache, table), (wqkv, wo, wgu, wd) in zip(layers, weights, strict=True):
            torch.mm(x, wqkv.t())
            if cfg is not None:
                with setting(cfg):
                    decode_attention(q, cache, lens, table, D**-0.5, out=out, num_splits=1)
            torch.mm(x, wo.t())
            torch.mm(x, wgu.t())
            torch.mm(h, wd.t())

    def timed(cfg: dict | None) -> float:
        step(cfg)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(cfg)
        # --long: 200 timed replays after 100 (~5 s of steady load, as a decode phase runs).
        iters, warmup = (200, 100) if "--long" in sys.argv else (10, 3)
        return median_ms(graph.replay, iters=iters, warmup=warmup) * 1e3 / LAYERS

    nbytes = batch * ctx * HKV * D * 2 * 2
    rows = []
    print("\n| b256 x 1152 between GEMMs | stages | head-major | step us/layer | GEMMs only | "
          "attention us | of read |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for rep in range(2):
        for cfg in FOUR:
            gemms = timed(None)
            both = timed(cfg)
            att = both - gemms
            rows.append(
                {**cfg, "rep": rep, "step_us": both, "gemms_us": gemms, "attention_us": att}
            )
            print(
                f"| | {cfg['num_stages']} | {cfg['head_major']} | {both:.1f} | {gemms:.1f} | "
                f"{att:.1f} | {nbytes / (att / 1e6) / read_bps:.3f} |"
            )
    return rows


def layout_rows(read_bps: float) -> list[dict]:
    """Four settings on three cache layouts: separate tensors a layer, random pages (the sweep's
    default), and the engine's one tensor with pages in allocation order or shuffled."""
    print(
        "\n| layout | shape | stages | head-major | us/layer | of read |\n|---|---|---|---|---|---|"
    )
    cases = []
    # The engine's decode graphs hold seq_lens as int64 (one int64 buffer for every row input).
    runs = [("separate", torch.int32), ("engine-seq", torch.int32), ("engine-seq", torch.int64)]
    if "--all-layouts" in sys.argv:
        runs += [("engine-perm", torch.int32), ("engine-perm", torch.int64)]
    for layout, lens_dtype in runs:
        for batch, ctx in ((256, 1152), (64, 1024)):
            c = case(batch, ctx, FOUR, [1], read_bps, layout, lens_dtype)
            cases.append(c)
            for r in c["rows"]:
                print(
                    f"| {layout}, {str(lens_dtype)[6:]} lens | b{batch} x {ctx} | "
                    f"{r['num_stages']} | {r['head_major']} | {r['us']:.1f} | {r['of_read']:.3f} |"
                )
    return cases


SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def splits_rows(read_bps: float) -> list[dict]:
    """Every split count at each (batch, context), the default setting; the rule's picks."""
    rows = []
    print("\n| batch x ctx | best splits | us | rule (4/SM) | us | of best | 2/SM | 3/SM | 6/SM |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in (1, 4, 16, 32, 48, 64, 96, 128, 192, 256):
        for ctx in (1024, 4096, 16384):
            layers = [paged_layer(batch, ctx) for _ in range(layers_for(batch, ctx))]
            q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            picks = {
                per: choose_num_splits(batch, HKV, ctx, num_sms(q), programs_per_sm=per)
                for per in (2, 3, 4, 6)
            }
            counts = {n for n in SPLIT_COUNTS if n <= max(1, ctx // 64)} | set(picks.values())
            us = {n: graph_us(q, layers, lens, n, {}) for n in sorted(counts)}
            best = min(us, key=us.get)
            rule = {per: {"splits": n, "us": us[n]} for per, n in picks.items()}
            rows.append({"batch": batch, "ctx": ctx, "us": us, "best": best, "rule": rule})
            print(
                f"| {batch} x {ctx} | {best} | {us[best]:.1f} | {picks[4]} | {rule[4]['us']:.1f} | "
                f"{us[best] / rule[4]['us']:.3f} | "
                + " | ".join(f"{picks[p]}: {us[best] / rule[p]['us']:.3f}" for p in (2, 3, 6))
                + " |"
            )
            del layers
            torch.cuda.empty_cache()
    return rows


MODES = {"--interleaved": interleaved_rows, "--layouts": layout_rows, "--splits": splits_rows}


def write(name: str, gpu: str, out: dict) -> None:
    dest = Path(os.environ.get("OUT") or "benchmarks/results")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{name}-{gpu.replace(' ', '_')}.json").write_text(json.dumps(out, indent=2))


def main() -> None:
    gpu = torch.cuda.get_device_name()
    for flag, rows in MODES.items():
        if flag in sys.argv:
            read = read_bandwidth()
            name = flag.removeprefix("--")
            write(
                f"decode_attention_{name}",
                gpu,
                {"gpu": gpu, "read": read, name: rows(read["bytes_per_s"])},
            )
            return
    copy_bps = copy_bandwidth()
    read = read_bandwidth()
    print(
        f"GPU: {gpu}; copy {copy_bps / 1e9:.0f} GB/s; read {read['bytes_per_s'] / 1e9:.0f} GB/s {read}"
    )
    quick = "--quick" in sys.argv
    full = [
        {"block_n": n, "num_warps": w, "num_stages": st, "head_major": hm}
        for n, w, st, hm in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (False, True))
    ]
    if quick:
        full = [c for c in full if c["block_n"] == 64 and c["num_stages"] in (2, 3)]
    out: dict = {"gpu": gpu, "copy_bytes_per_s": copy_bps, "read": read, "cases": []}
    main_case = case(256, 1152, full, [1, 2], read["bytes_per_s"])
    out["cases"].append(main_case)
    ok = [r for r in main_case["rows"] if "us" in r]
    ok.sort(key=lambda r: r["us"])
    before = next(r for r in ok if r["splits"] == 1 and all(r[k] == v for k, v in BEFORE.items()))
    print(
        "\n| b256 x 1152 | splits | block_n | warps | stages | head-major | us/layer | GB/s | of read |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in ok[:12] + [before]:
        print(
            f"| {'earlier' if r is before else ''} | {r['splits']} | {r['block_n']} | "
            f"{r['num_warps']} | {r['num_stages']} | {r['head_major']} | {r['us']:.1f} | "
            f"{r['gb_s']:.0f} | {r['of_read']:.3f} |"
        )
    # The best few settings on the other shapes the engine meets, against the earlier one.
    best = [{k: r[k] for k in BEFORE} for r in ok[:4]]
    others = [BEFORE] + [c for c in best if c != BEFORE]
    print("\n| shape | splits | setting | us/layer | of read |\n|---|---|---|---|---|")
    sms = num_sms(torch.empty(0, device="cuda"))
    for batch, ctx in ((256, 1024), (256, 1280), (128, 2048), (64, 1024), (8, 4096), (1, 8192)):
        auto = choose_num_splits(batch, HKV, ctx, sms)
        c = case(batch, ctx, others, sorted({auto, 1}), read["bytes_per_s"])
        out["cases"].append(c)
        for r in c["rows"]:
            if "us" in r:
                print(
                    f"| b{batch} x {ctx} | {r['splits']} | {r['block_n']}/{r['num_warps']}w/"
                    f"{r['num_stages']}s{'/hm' if r['head_major'] else ''} | {r['us']:.1f} | "
                    f"{r['of_read']:.3f} |"
                )
    write("decode_attention_sweep", gpu, out)


if __name__ == "__main__":
    main()
