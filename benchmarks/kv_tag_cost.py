"""What the keyed tags on transferred KV blocks cost (ember/kv/transport/block_tags.py), on a GPU.

A prefill engine tags the blocks it leases and the decode engine recomputes the tags over what it
read, so a transfer of B bytes over a link of rate R takes B / R and the tags add 2 * B / T (T: the
tag rate, kernel, host copy of the sums and masks included). This script, on one GPU, for the 8B
shape's blocks (Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, 16 tokens a block, bf16: 2 MiB):

- checks the Triton NH kernel against its NumPy reference on fresh random blocks;
- measures T for leases of 64, 256 and 1024 blocks (1k, 4k and 16k tokens), and in the same run
  the card's copy rate (device to device: the memory-bandwidth ceiling, and what CUDA IPC moves on
  one node) and the pinned host link (device to host and back: PCIe, the stand-in for an RDMA NIC);
- prints each lease's tag time against its transfer time at the measured host link and at 50 GB/s
  (a 400 Gb/s RDMA NIC) and 12.5 GB/s (100 Gb/s), and writes JSON.

Run: python benchmarks/kv_tag_cost.py --out results.json (needs a CUDA GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ember.kernels.kv_tag import nh_sums, nh_sums_reference
from ember.kv.transport.block_tags import BlockTagger

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LEASES = (64, 256, 1024)
LINKS_GBPS = {"rdma_400g": 50.0, "tcp_100g": 12.5}


def timed(fn, repeat: int = 10) -> float:  # noqa: ANN001
    """Median seconds of `fn()` (synchronized), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check_kernel(cache: torch.Tensor, tagger: BlockTagger) -> int:
    """The kernel's sums against the reference on 12 random blocks; returns how many checked."""
    ids = torch.randperm(cache.shape[0])[:12].tolist()
    words = cache.view(cache.shape[0], -1).view(torch.int32)
    got = nh_sums(words, tagger._key_dev, torch.tensor(ids, device=cache.device))  # noqa: SLF001
    host = words[ids].cpu().numpy().view(np.uint32)
    want = nh_sums_reference(host, tagger._key)  # noqa: SLF001
    if not np.array_equal(got, want):
        raise SystemExit("the NH kernel disagrees with its reference")
    return len(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--sweep", action="store_true", help="also time other tilings of the kernel")
    args = p.parse_args()
    dev = torch.device("cuda")
    num_blocks = max(LEASES) + 64
    cache = torch.randn(
        (num_blocks, LAYERS, 2, BLOCK, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=dev
    )
    block_bytes = cache[0].numel() * cache.element_size()
    tagger = BlockTagger("benchmark-secret", cache)
    checked = check_kernel(cache, tagger)
    words = cache.view(num_blocks, -1).view(torch.int32)

    n_copy = max(LEASES)
    src = cache[:n_copy]
    dst = torch.empty_like(src)
    d2d = timed(lambda: dst.copy_(src))
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    d2h = timed(lambda: pinned.copy_(src, non_blocking=True))
    h2d = timed(lambda: dst.copy_(pinned, non_blocking=True))
    copy_bytes = n_copy * block_bytes
    rates = {
        "d2d_gbps": copy_bytes / d2d / 1e9,
        # A copy reads and writes: the bandwidth it used is twice what it moved.
        "hbm_gbps": 2 * copy_bytes / d2d / 1e9,
        "d2h_gbps": copy_bytes / d2h / 1e9,
        "h2d_gbps": copy_bytes / h2d / 1e9,
    }
    host_link = min(rates["d2h_gbps"], rates["h2d_gbps"])
    links = {"host_link": host_link, **LINKS_GBPS, "cuda_ipc_same_gpu": rates["d2d_gbps"]}

    rows = []
    for n in LEASES:
        ids = torch.randperm(num_blocks)[:n].tolist()
        t = timed(lambda ids=ids: tagger.tags(ids, "lease:bench"))
        dev_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        kernel = timed(lambda ids=dev_ids: nh_sums(words, tagger._key_dev, ids))  # noqa: SLF001
        nbytes = n * block_bytes
        row = {
            "blocks": n,
            "tokens": n * BLOCK,
            "bytes": nbytes,
            "tag_s": t,
            "tag_gbps": nbytes / t / 1e9,
            "kernel_s": kernel,
            "kernel_gbps": nbytes / kernel / 1e9,
            "tag_hbm_fraction": nbytes / t / 1e9 / rates["hbm_gbps"],
        }
        for name, gbps in links.items():
            transfer = nbytes / (gbps * 1e9)
            row[f"share_{name}"] = 2 * t / transfer  # both sides tag, once each
        rows.append(row)

    sweep = []
    if args.sweep:
        ids = torch.randperm(num_blocks, device=dev)[: max(LEASES)]
        for chunk in (512, 1024, 2048, 4096):
            for steps in (2, 4, 8, 16, 32):
                for warps in (4, 8, 16):

                    def run(chunk=chunk, steps=steps, warps=warps):  # noqa: ANN202
                        return nh_sums(words, tagger._key_dev, ids, chunk, steps, warps)  # noqa: SLF001

                    t = timed(run, repeat=5)
                    gbps = len(ids) * block_bytes / t / 1e9
                    sweep.append({"chunk": chunk, "steps": steps, "warps": warps, "gbps": gbps})
        sweep.sort(key=lambda r: -r["gbps"])
        print("best tilings (1024 blocks):", sweep[:5])
    gpu = torch.cuda.get_device_name()
    print(
        f"{gpu}: 8B-shape KV blocks of {block_bytes / 2**20:.1f} MiB; kernel checked on {checked}"
    )
    print(
        f"copy d2d {rates['d2d_gbps']:.0f} GB/s (HBM {rates['hbm_gbps']:.0f}), "
        f"d2h {rates['d2h_gbps']:.1f}, h2d {rates['h2d_gbps']:.1f} GB/s"
    )
    head = f"{'blocks':>7} {'tokens':>7} {'tag ms':>8} {'tag GB/s':>9} {'kernel GB/s':>12}"
    head += f" {'of HBM':>7}"
    head += "".join(f" {k:>18}" for k in links)
    print(head)
    for r in rows:
        line = f"{r['blocks']:>7} {r['tokens']:>7} {r['tag_s'] * 1e3:>8.2f} {r['tag_gbps']:>9.0f}"
        line += f" {r['kernel_gbps']:>12.0f}"
        line += f" {r['tag_hbm_fraction']:>7.2f}"
        line += "".join(f" {r[f'share_{k}']:>17.1%} " for k in links)
        print(line)
    result = {
        "gpu": gpu,
        "block_bytes": block_bytes,
        "kernel_checked_blocks": checked,
        "rates": rates,
        "links_gbps": links,
        "rows": rows,
        "sweep": sweep,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
