"""The attention kernels alone, against their floors and a baseline, on the Llama-3-8B attention
shape (32 query heads, 8 KV heads, head_dim 128, bf16, block size 16):

- prefill: 8 sequences x 2048 tokens, causal, TFLOP/s of ember's kernel (each tile config tried)
  against torch's scaled_dot_product_attention (flash) on the same, unpaged, tensors; fresh
  prompts (no cached prefix) of 1 x 16384, 16 x 1024 and 64 x 256 through the TMA kernel, the
  pointer kernel and cuDNN;
- decode: batch 1 x 512, 1 x 4096, 64 x 1024 and 128 x 1024 contexts: GB/s of K/V read;
- a mixed step's prefill rows (the mixed load's: one chunk continuing a prompt, then fresh
  prompts of 1,024): ember's paged kernel over every row, against the paged kernel for the
  continuing chunk and flash attention for the fresh rows (one SDPA call per row, or one varlen
  call), in us per layer (32 layers back to back); and each flash route's first call on a
  prompt length it has not seen (cuDNN builds a plan per shape);
- extend: chunks over a cached prefix (an agent's next turn), the paged kernels over pages of
  16 and 64 tokens (TMA on 64) against FlashAttention-2's varlen kernel on unpaged K and V.

Prints tables and writes JSON to $OUT (or benchmarks/results/), named with the GPU.
`--prefill-only`: the first two tables; `--extend-only`: the extend table and the decode tables
(pages of 16 and 64). `EMBER_TREE=DIR`: measure DIR's ember (e.g. an earlier commit's tree)
instead of this one's.

Run on a CUDA GPU:

    python benchmarks/probes/attention_kernels.py
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# EMBER_TREE: another tree's ember (an earlier commit's, under .ab/), its kernels measured
# beside the working tree's in the same call.
sys.path.insert(0, os.environ.get("EMBER_TREE") or str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import copy_bandwidth, median_ms  # noqa: E402

import ember.kernels.prefill_attention as pa  # noqa: E402
from ember.kernels.decode_attention import decode_attention  # noqa: E402
from ember.kernels.prefill_attention import prefill_attention  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def bench(fn) -> float:
    """Median seconds of one call (CUDA events), as the engine benchmark times."""
    return median_ms(fn) / 1e3


def paged(seq_lens: list[int], bs: int = BS):
    blocks = [-(-n // bs) for n in seq_lens]
    total = sum(blocks)
    cache = torch.randn(total, 2, bs, HKV, D, dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    width = max(blocks)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
    start = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = perm[start : start + nb]
        start += nb
    return cache, table


def prefill_rows(out: dict) -> None:
    n, L = 8, 2048
    cache, table = paged([L] * n)
    q = torch.randn(n * L, HQ, D, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(0, (n + 1) * L, L, dtype=torch.int32, device="cuda")
    lens = torch.full((n,), L, dtype=torch.int32, device="cuda")
    flops = n * 4 * (L * L / 2) * HQ * D
    base = pa._tile_config
    rows = {}
    for bn, warps, stages in ((64, 8, 3), (128, 8, 2), (64, 4, 3), (128, 8, 3), (64, 8, 2)):
        pa._tile_config = lambda h, m, f=False, bn=bn, w=warps, s=stages: (128, bn, w, s)
        try:
            t = bench(lambda: prefill_attention(q, cache, qsl, lens, table, D**-0.5, L))
            rows[f"BLOCK_N={bn} warps={warps} stages={stages}"] = flops / t / 1e12
        except Exception as e:  # a config that does not fit shared memory
            rows[f"BLOCK_N={bn} warps={warps} stages={stages}"] = f"failed: {type(e).__name__}"
    pa._tile_config = base
    kf = torch.randn(n * L, HKV, D, dtype=torch.bfloat16, device="cuda")
    vf = torch.randn(n * L, HKV, D, dtype=torch.bfloat16, device="cuda")
    for name, tma in (("ember fresh, TMA kernel (the default on Hopper)", True),
                      ("ember fresh, pointer kernel", False)):  # fmt: skip
        t = bench(
            lambda tma=tma: prefill_attention(
                q, cache, qsl, lens, table, D**-0.5, L, k=kf, v=vf, tma=tma
            )
        )
        rows[name] = flops / t / 1e12
    qd = torch.randn(n, HQ, L, D, dtype=torch.bfloat16, device="cuda")
    kd = torch.randn(n, HKV, L, D, dtype=torch.bfloat16, device="cuda")
    vd = torch.randn(n, HKV, L, D, dtype=torch.bfloat16, device="cuda")
    t = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
    rows["torch sdpa (unpaged, causal)"] = flops / t / 1e12
    qv = torch.randn(n * L, HQ, D, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(n * L, HKV, D, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(0, (n + 1) * L, L, dtype=torch.int32, device="cuda")
    t = bench(lambda: _varlen_flash(qv, kv, kv, cu, L))
    rows["torch varlen flash (unpaged, causal)"] = flops / t / 1e12
    out["prefill_tflops"] = rows
    print("\n| prefill 8 x 2048 causal | TFLOP/s |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v if isinstance(v, str) else f'{v:.0f}'} |")


def _fresh_shape(n: int, L: int) -> dict[str, float]:
    """TFLOP/s of n fresh causal prompts of L tokens: the TMA and pointer kernels, cuDNN SDPA."""
    q = torch.randn(n * L, HQ, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(n * L, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(n * L, HKV, D, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(0, (n + 1) * L, L, dtype=torch.int32, device="cuda")
    lens = torch.full((n,), L, dtype=torch.int32, device="cuda")
    cache = torch.empty(1, 2, BS, HKV, D, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(n, 1, dtype=torch.int32, device="cuda")
    flops = n * 4 * (L * L / 2) * HQ * D
    r = {}
    for name, tma in (("TMA", True), ("pointers", False)):
        t = bench(
            lambda tma=tma: prefill_attention(
                q, cache, qsl, lens, table, D**-0.5, L, k=k, v=v, tma=tma
            )
        )
        r[name] = flops / t / 1e12
    qd, kd, vd = (x.view(n, L, -1, D).transpose(1, 2).contiguous() for x in (q, k, v))
    t = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
    r["cuDNN SDPA"] = flops / t / 1e12
    return r


def fresh_rows(out: dict) -> None:
    """Fresh prompts of other lengths than prefill_rows' 8 x 2048."""
    rows = {f"{n} x {L}": _fresh_shape(n, L) for n, L in ((1, 16384), (16, 1024), (64, 256))}
    out["fresh_tflops"] = rows
    print("\n| fresh causal prompts | TMA | pointers | cuDNN SDPA |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['TMA']:.0f} | {r['pointers']:.0f} | {r['cuDNN SDPA']:.0f} |")


EXTEND = ((1, 16384, 1024), (1, 32768, 2048), (4, 8192, 1024), (8, 2048, 512), (32, 1024, 128))
"""(sequences, cached prefix, new tokens): an agent's next turn over its cached conversation."""


def _extend_shape(n: int, cached: int, new: int) -> dict[str, float]:
    """TFLOP/s of n chunks of `new` tokens over `cached` tokens already in the cache, causal:
    ember's paged kernel over 16- and 64-token pages (pointer loads) and over 64-token pages
    through the TMA kernel, against FlashAttention-2's varlen kernel (torch's, unpaged: K and V
    contiguous per sequence, the causal mask aligned bottom-right)."""
    total = cached + new
    q = torch.randn(n * new, HQ, D, dtype=torch.bfloat16, device="cuda")
    qsl = torch.arange(0, (n + 1) * new, new, dtype=torch.int32, device="cuda")
    lens = torch.full((n,), total, dtype=torch.int32, device="cuda")
    flops = n * 4 * HQ * D * new * (total - new / 2)
    r = {}
    for name, bs, tma in (("pointers, pages of 16", 16, False), ("pointers, pages of 64", 64, False),
                          ("TMA, pages of 64", 64, True)):  # fmt: skip
        cache, table = paged([total] * n, bs)
        t = bench(lambda c=cache, tb=table, tma=tma: prefill_attention(
            q, c, qsl, lens, tb, D**-0.5, new, tma=tma))  # fmt: skip
        r[name] = flops / t / 1e12
        del cache
    k = torch.randn(n * total, HKV, D, dtype=torch.bfloat16, device="cuda")
    cu_k = torch.arange(0, (n + 1) * total, total, dtype=torch.int32, device="cuda")
    t = bench(lambda: torch.ops.aten._flash_attention_forward(
        q, k, k, qsl, cu_k, new, total, 0.0, True, False, scale=D**-0.5)[0])  # fmt: skip
    r["flash varlen (unpaged)"] = flops / t / 1e12
    return r


def extend_rows(out: dict) -> None:
    """Chunks continuing cached prompts (an agent's turn, a chunked prefill) through the cache."""
    rows = {f"{n} x ({c} + {m})": _extend_shape(n, c, m) for n, c, m in EXTEND}
    out["extend_tflops"] = rows
    names = list(next(iter(rows.values())))
    print("\n| extend: n x (cached + new), TFLOP/s | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for case, r in rows.items():
        print(f"| {case} | " + " | ".join(f"{r[k]:.0f}" for k in names) + " |")


def _varlen_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, m: int):
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, m, m, 0.0, True, False, scale=D**-0.5
    )[0]


def _per_row_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int]):
    out = torch.empty_like(q)
    for s, e in zip(starts, starts[1:], strict=False):
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0),
            k[s:e].transpose(0, 1).unsqueeze(0),
            v[s:e].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=D**-0.5,
            enable_gqa=True,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def mixed_step_rows(out: dict) -> None:
    """16 prefill rows of a 16k-token step: a chunk of 924 new tokens over a 1,024 context, then
    15 fresh prompts of 1,024."""
    layers, fresh, L, chunk = 32, 15, 1024, 924
    cache, table = paged([L] * (fresh + 1))
    total = chunk + fresh * L
    starts = [0, chunk] + [chunk + L * (i + 1) for i in range(fresh)]
    q = torch.randn(total, HQ, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda")
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    lens = torch.full((fresh + 1,), L, dtype=torch.int32, device="cuda")
    cu = (qsl[1:] - chunk).to(torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), cu])
    scale = D**-0.5

    def paged_all() -> None:
        for _ in range(layers):
            prefill_attention(q, cache, qsl, lens, table, scale, L)

    def chunk_only() -> None:
        prefill_attention(q, cache, qsl[:2], lens[:1], table[:1], scale, L)

    def split_pointers() -> None:
        for _ in range(layers):
            chunk_only()
            prefill_attention(q, cache, qsl[1:], lens[1:], table[1:], scale, L, k=k, v=v, tma=False)

    def split_sdpa() -> None:
        for _ in range(layers):
            chunk_only()
            _per_row_sdpa(q[chunk:], k[chunk:], v[chunk:], [s - chunk for s in starts[1:]])

    def split_varlen() -> None:
        for _ in range(layers):
            chunk_only()
            _varlen_flash(q[chunk:], k[chunk:], v[chunk:], cu, L)

    def split_fresh() -> None:
        for _ in range(layers):
            chunk_only()
            prefill_attention(q, cache, qsl[1:], lens[1:], table[1:], scale, L, k=k, v=v)

    rows: dict[str, float | str] = {}
    for name, fn in (
        ("paged kernel, all 16 rows", paged_all),
        ("paged chunk + ember fresh kernel (what the engine does)", split_fresh),
        ("paged chunk + ember fresh pointer kernel", split_pointers),
        ("paged chunk + SDPA per fresh row", split_sdpa),
        ("paged chunk + one varlen flash call", split_varlen),
    ):
        try:
            rows[name] = bench(fn) * 1e6 / layers
        except Exception as e:  # an op this torch lacks
            rows[name] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    # A prompt length never seen: the first call's host time (cuDNN plans per shape).
    first: dict[str, float | str] = {}
    for name, call in (
        ("SDPA (default backend)", lambda n, t: _per_row_sdpa(t, t[:, :HKV], t[:, :HKV], [0, n])),
        ("varlen flash", None),
    ):
        times = []
        try:
            for n in range(301, 309):
                t = torch.randn(n, HQ, D, dtype=torch.bfloat16, device="cuda")
                kk = t[:, :HKV].contiguous()
                c = torch.tensor([0, n], dtype=torch.int32, device="cuda")

                def once(
                    n: int = n, t: torch.Tensor = t, kk: torch.Tensor = kk, c=c, call=call
                ) -> float:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if call is None:
                        _varlen_flash(t, kk, kk, c, n)
                    else:
                        call(n, t)
                    torch.cuda.synchronize()
                    return (time.perf_counter() - t0) * 1e3

                times.append((once(), once()))  # the first call on this length, then again
            first[name] = {
                "first_ms_median": statistics.median(a for a, _ in times),
                "again_ms_median": statistics.median(b for _, b in times),
            }
        except Exception as e:
            first[name] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    out["mixed_step_us_per_layer"] = rows
    out["new_length_first_call"] = first
    print("\n| mixed step's prefill rows (1 chunk + 15 fresh x 1024) | us per layer |\n|---|---|")
    for name, val in rows.items():
        print(f"| {name} | {val if isinstance(val, str) else f'{val:.0f}'} |")
    print("\n| a new prompt length | first call ms | again ms |\n|---|---|---|")
    for name, val in first.items():
        if isinstance(val, str):
            print(f"| {name} | {val} | |")
        else:
            print(f"| {name} | {val['first_ms_median']:.2f} | {val['again_ms_median']:.2f} |")


_next_length = 1301


def _mla_sdpa_row(
    backend: object, h: int, dqk: int, dv: int, n: int, hkv: int | None = None
) -> dict[str, float]:
    """One SDPA backend on one fresh causal sequence of `n` (GQA when `hkv` < `h`)."""
    from torch.nn.attention import sdpa_kernel

    hk = hkv or h

    def call(length: int, timed: bool = False) -> float:
        q = torch.randn(1, h, length, dqk, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(1, hk, length, dqk, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(1, hk, length, dv, dtype=torch.bfloat16, device="cuda")
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        gqa = {"enable_gqa": True} if hk != h else {}
        with ctx:
            if timed:
                return bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3

    t = call(n, timed=True)
    flops = 2 * h * (n * n / 2) * (dqk + dv)
    # Lengths no call of this process has used yet: torch caches cuDNN's plans per shape, so a
    # backend timed after another on the same lengths would find them built (a first version of
    # this table did, and showed forced cuDNN at 0.09 ms a new length).
    global _next_length
    firsts = [call(length) for length in range(_next_length, _next_length + 5)]
    _next_length += 5
    return {"tflops": flops / t / 1e12, "new_length_ms": statistics.median(firsts)}


def mla_sdpa_rows(out: dict) -> None:
    """MLA's expanded prefill (ember/attention/mla.py): torch SDPA over per-head K [qk 192] and
    V [128], 16 heads (Moonlight's shape), one fresh causal sequence per call, through each
    backend torch has for it: TFLOP/s at 2,048 tokens, and the first call on new lengths."""
    from torch.nn.attention import SDPBackend

    rows: dict[str, object] = {}
    for name, backend in (
        ("default", None),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            rows[name] = _mla_sdpa_row(backend, 16, 192, 128, 2048)
        except Exception as e:
            rows[name] = f"failed: {type(e).__name__}: {str(e)[:80]}"
        # The Llama-3-8B shape (32 heads over 8 KV heads, d 128) the same way.
        try:
            rows[f"llama {name}"] = _mla_sdpa_row(backend, 32, 128, 128, 2048, hkv=8)
        except Exception as e:
            rows[f"llama {name}"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    out["mla_sdpa"] = rows
    print("\n| MLA expanded prefill, 16 heads, qk 192 / v 128 | TFLOP/s | new length, ms |")
    print("|---|---|---|")
    for name, r in rows.items():
        if isinstance(r, str):
            print(f"| {name} | {r} | |")
        else:
            print(f"| {name} | {r['tflops']:.0f} | {r['new_length_ms']:.2f} |")


def decode_rows(out: dict, bw: float) -> None:
    """One eager call per timing (CUDA events around it): the host's launch time is inside, so the
    small cases (b1: ~100-160 us for a few microseconds of work) time Python, not the kernel, and
    move by tens of microseconds between runs; `decode_graph_rows` times the kernel."""
    rows = {}
    print("\n| decode | us | K/V GB/s | of copy bandwidth |\n|---|---|---|---|")
    cases = [(b, ctx, BS) for b, ctx in ((1, 512), (1, 4096), (64, 1024), (128, 1024))]
    for b, ctx, bs in cases + [(b, ctx, 64) for b, ctx in ((1, 4096), (64, 1024), (128, 1024))]:
        cache, table = paged([ctx] * b, bs)
        q = torch.randn(b, HQ, D, dtype=torch.bfloat16, device="cuda")
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        t = bench(
            lambda q=q, c=cache, n=lens, tb=table: decode_attention(
                q, c, n, tb, D**-0.5, max_seq_len=4096
            )
        )
        nbytes = b * ctx * HKV * D * 2 * 2
        name = f"b{b} x {ctx}" + ("" if bs == BS else f", pages of {bs}")
        rows[name] = {"us": t * 1e6, "gb_s": nbytes / t / 1e9}
        print(f"| {name} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | {nbytes / t / bw:.2f} |")
    out["decode"] = rows


def graph_us_per_layer(layers: list, q: torch.Tensor, lens: torch.Tensor, splits: int) -> float:
    """Capture one decode call per layer back to back in a CUDA graph; median us per call."""

    def stack() -> None:
        for cache, table in layers:
            decode_attention(q, cache, lens, table, D**-0.5, num_splits=splits)

    stack()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stack()
    return median_ms(graph.replay) * 1e3 / len(layers)


def decode_graph_rows(out: dict) -> None:
    """Decode attention as the engine's CUDA graphs run it: 32 calls (one per layer, each on its own
    cache, so nothing stays in L2) captured back to back, timed per call, for each split count a
    graph may be captured with. (A floor on keys per split, read on the device so that short
    contexts leave most splits empty, was measured here too and was slower everywhere: a longer
    chain of tiles per program costs more than the extra programs; removed.)"""
    rows = {}
    print("\n| decode in a graph | pages | splits | us per layer |\n|---|---|---|---|")
    for b, ctx in ((1, 512), (1, 2048), (8, 1024), (64, 1024)):
        for bs in (BS, 64):
            layers = [paged([ctx] * b, bs) for _ in range(32)]
            q = torch.randn(b, HQ, D, dtype=torch.bfloat16, device="cuda")
            lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
            for splits in (1, 2, 4, 8, 16, 32):
                us = graph_us_per_layer(layers, q, lens, splits)
                rows[f"b{b} x {ctx} s{splits}" + ("" if bs == BS else f" pages of {bs}")] = us
                print(f"| b{b} x {ctx} | {bs} | {splits} | {us:.1f} |")
            del layers
    out["decode_in_graph_us"] = rows


def main() -> None:
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    out: dict = {"gpu": gpu, "copy_bytes_per_s": bw}
    print(f"GPU: {gpu}; copy {bw / 1e9:.0f} GB/s")
    if "--extend-only" in sys.argv:
        extend_rows(out)
        decode_rows(out, bw)
        decode_graph_rows(out)
        dest = Path(os.environ.get("OUT") or "benchmarks/results")
        name = f"attention_kernels-extend-{gpu.replace(' ', '_')}.json"
        (dest / name).write_text(json.dumps(out, indent=2))
        return
    if "--mla-only" in sys.argv:
        mla_sdpa_rows(out)
        print(json.dumps(out["mla_sdpa"]))
        return
    prefill_rows(out)
    fresh_rows(out)
    mixed_step_rows(out)
    extend_rows(out)
    if "--prefill-only" not in sys.argv:
        mla_sdpa_rows(out)
        decode_rows(out, bw)
        decode_graph_rows(out)
    dest = Path(os.environ.get("OUT") or "benchmarks/results")
    (dest / f"attention_kernels-{gpu.replace(' ', '_')}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
