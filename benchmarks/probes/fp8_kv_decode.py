"""Decode attention over an FP8 KV cache against a bf16 one, by tile size: whether the kernels,
tuned for bf16, read an FP8 cache at the card's bandwidth, and which keys-a-tile make them.

- MHA (`ember.kernels.decode_attention`, the Llama-3.1-8B shape: 32 query heads, 8 KV heads of
  128, pages of 64): `--batch` rows over `--context` tokens, one layer's cache; BLOCK_N x
  NUM_STAGES.
- MLA (`ember.kernels.mla_decode`, 16 and 64 heads, rank 512 + 64 rope): the same rows;
  block_n x num_warps.

Each setting is checked against the default's output, then timed (median of CUDA-event-timed
calls); GB/s is the cache bytes the rows read over the time.

    python benchmarks/probes/fp8_kv_decode.py [--batch 32] [--context 8000]

Prints tables and writes fp8_kv_decode-<GPU>-<date>.json to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_gpu import median_ms  # noqa: E402
from result_names import result_path  # noqa: E402

from ember.kernels import decode_attention as mha  # noqa: E402
from ember.kernels.kv_dtype import to_cache  # noqa: E402
from ember.kernels.mla_decode import mla_decode  # noqa: E402

PAGE = 64
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def tables(batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    per = -(-context // PAGE)
    blocks = torch.randperm(batch * per, device="cuda").to(torch.int32).view(batch, per)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return blocks, lens, batch * per


def mha_rows(batch: int, context: int) -> list[dict]:
    blocks, lens, n = tables(batch, context)
    base = torch.randn(n, 2, PAGE, 8, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, 32, 128, dtype=torch.bfloat16, device="cuda")
    rows = []
    for name, dt in DTYPES.items():
        cache = to_cache(base, dt)
        nbytes = batch * context * 2 * 8 * 128 * cache.element_size()
        want = None
        for block_n in (64, 128, 256):
            for stages in (2, 3, 4):
                mha.BLOCK_N, mha.NUM_STAGES = block_n, stages
                try:

                    def call(cache: torch.Tensor = cache) -> torch.Tensor:
                        return mha.decode_attention(
                            q, cache, lens, blocks, 0.088, max_seq_len=context
                        )

                    out = call()
                    want = out if want is None else want
                    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                    ms = median_ms(call, iters=30)
                except Exception as e:  # (a tile too large for shared memory)
                    rows.append(
                        {"kind": "mha", "kv": name, "block_n": block_n, "error": str(e)[:80]}
                    )
                    continue
                rows.append(
                    {
                        "kind": "mha",
                        "kv": name,
                        "block_n": block_n,
                        "stages": stages,
                        "us": round(ms * 1e3, 1),
                        "gb_s": round(nbytes / (ms / 1e3) / 1e9),
                        "rel_err_to_first": round(err, 5),
                    }
                )
    mha.BLOCK_N, mha.NUM_STAGES = None, 3
    return rows


def mla_rows(batch: int, context: int, heads: int) -> list[dict]:
    blocks, lens, n = tables(batch, context)
    base = torch.randn(n, 1, PAGE, 1, 576, dtype=torch.bfloat16, device="cuda")
    ql = torch.randn(batch, heads, 512, dtype=torch.bfloat16, device="cuda")
    qr = torch.randn(batch, heads, 64, dtype=torch.bfloat16, device="cuda")
    rows = []
    for name, dt in DTYPES.items():
        cache = to_cache(base, dt)
        nbytes = batch * context * 576 * cache.element_size()
        want = None
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                try:

                    def call(
                        cache: torch.Tensor = cache, block_n: int = block_n, warps: int = warps
                    ) -> torch.Tensor:
                        return mla_decode(
                            ql,
                            qr,
                            cache,
                            lens,
                            blocks,
                            0.07,
                            max_seq_len=context,
                            block_n=block_n,
                            num_warps=warps,
                        )

                    out = call()
                    want = out if want is None else want
                    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
                    ms = median_ms(call, iters=30)
                except Exception as e:
                    rows.append(
                        {
                            "kind": f"mla{heads}",
                            "kv": name,
                            "block_n": block_n,
                            "error": str(e)[:80],
                        }
                    )
                    continue
                rows.append(
                    {
                        "kind": f"mla{heads}",
                        "kv": name,
                        "block_n": block_n,
                        "warps": warps,
                        "us": round(ms * 1e3, 1),
                        "gb_s": round(nbytes / (ms / 1e3) / 1e9),
                        "rel_err_to_first": round(err, 5),
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8000)
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name(0)
    rows = mha_rows(args.batch, args.context)
    for heads in (16, 64):
        rows += mla_rows(args.batch, args.context, heads)
    print(f"## decode attention, {args.batch} rows x {args.context} tokens, {gpu}")
    print("| kernel | KV | keys a tile | stages / warps | us | GB/s | rel. err. |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | {r['kv']} | {r['block_n']} | - | {r['error']} | | |")
            continue
        knob = r.get("stages", r.get("warps"))
        print(
            f"| {r['kind']} | {r['kv']} | {r['block_n']} | {knob} | {r['us']} | {r['gb_s']} "
            f"| {r['rel_err_to_first']} |"
        )
    path = result_path("fp8_kv_decode", gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"gpu": gpu, "batch": args.batch, "context": args.context, "rows": rows}, indent=1
        )
        + "\n"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
