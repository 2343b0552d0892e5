"""Reading a checkpoint onto the GPU: safetensors' own reads against ember's staged reader
(ember/models/weight_staging.py) at several reader counts and chunk sizes, from the page cache
(warm) and from the disk (cold: the files evicted first).

The checkpoint is benchmarks/served_gpu.py's `--weights files` (random bf16 under a Llama
checkpoint's names, one shard a layer; ~16 GB for the 8B shape). Every tensor is copied into a
GPU tensor as the model's loader would, then the device synchronized.

    python benchmarks/load_weights.py [--shape llama] [--threads 1,2,4,8,16] [--chunks 16,64,256]

Prints a table and writes
benchmarks/results/load_weights-<GPU>-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from cold_import import read_all  # noqa: E402
from engine_gpu import SHAPES  # noqa: E402
from result_names import result_path  # noqa: E402
from served_gpu import evict_weights, model_dir, write_weights  # noqa: E402

from ember.models.checkpoint_files import safetensors_files  # noqa: E402
from ember.models.weight_staging import iter_safetensors, iter_staged  # noqa: E402

SMOKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
"""`--device cpu`: a shape small enough for a smoke test of this script."""


def timed(tensors, device: str) -> tuple[float, int]:
    """Seconds to take every tensor onto `device` (copied into a tensor of its own, as a
    parameter would be), and the bytes."""
    t0 = time.perf_counter()
    total = 0
    for _, t in tensors:
        dst = torch.empty(t.shape, dtype=t.dtype, device=device)
        dst.copy_(t)
        total += t.numel() * t.element_size()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama", choices=sorted(SHAPES))
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--chunks", default="16,64,256", help="chunk sizes in MiB (at 8 threads)")
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test")
    args = ap.parse_args()
    dev = args.device
    d = model_dir(args.shape)
    cfg = SHAPES[args.shape] if dev == "cuda" else {**SHAPES[args.shape], **SMOKE}
    t = time.perf_counter()
    size = write_weights(d, cfg, dev)
    print(f"wrote {size / 1e9:.1f} GB in {time.perf_counter() - t:.0f} s")
    files = safetensors_files(d)
    if dev == "cuda":
        torch.zeros(1, device=dev)
    cases: list[tuple[str, int, int]] = [("library", 1, 0)]
    cases += [("staged", n, 64) for n in map(int, args.threads.split(","))]
    cases += [("staged", 8, c) for c in map(int, args.chunks.split(",")) if c != 64]
    rows = []
    for mode in args.modes.split(","):
        for reader, threads, chunk in cases:
            if mode == "cold":
                evict_weights(d)
            else:  # warm: every file read once, so the page cache holds it
                read_all(files, 8)
            if reader == "library":
                it = ((n, t.to(dev)) for n, t in iter_safetensors(files))
            else:
                it = iter_staged(files, dev, threads=threads, chunk_bytes=chunk << 20)
            s, total = timed(it, dev)
            row = {"mode": mode, "reader": reader, "threads": threads, "chunk_mib": chunk}
            rows.append(row | {"seconds": s, "bytes": total, "gb_s": total / s / 1e9})
            print(
                f"{mode} {reader} threads {threads} chunk {chunk} MiB: {s:.2f} s, {total / s / 1e9:.1f} GB/s"
            )
            if dev == "cuda":
                torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"\n## {gpu}: {size / 1e9:.1f} GB of {args.shape} weights onto the GPU\n")
    print("| mode | reader | threads | chunk | s | GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        chunk = f"{r['chunk_mib']} MiB" if r["reader"] == "staged" else "-"
        print(
            f"| {r['mode']} | {r['reader']} | {r['threads']} | {chunk} | {r['seconds']:.2f} | "
            f"{r['gb_s']:.1f} |"
        )
    out = result_path("load_weights", gpu)
    out.write_text(
        json.dumps({"gpu": gpu, "shape": args.shape, "bytes": size, "rows": rows}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
