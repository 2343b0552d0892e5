"""A KV transfer over Mooncake with and without its keyed tags, between two CPU processes on
loopback (the path CPU engines on different hosts take; engines of one host use shared memory and
no tags). 8B-shape blocks (2 MiB). The owner tags its blocks when it leases them, the reader reads
them and recomputes the tags; both are timed, and the table gives the transfer's GB/s with and
without the tags. Writes JSON.

    python benchmarks/kv_transfer_tags_cpu.py [--blocks 64] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from multiprocessing.connection import Connection

import torch

from ember.kv.transport import make_transport, pair_regions
from ember.kv.transport.block_tags import BlockTagger

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SECRET = "benchmark-secret"


def shape(blocks: int) -> tuple[int, ...]:
    return (blocks, LAYERS, 2, BLOCK, HEADS, HEAD_DIM)


def owner(blocks: int, conn: Connection) -> None:
    """The prefill side: a random cache, registered; tags a lease of every block on request."""
    transport = make_transport("mooncake")
    cache = torch.randn(shape(blocks), dtype=torch.bfloat16)
    tagger = BlockTagger(SECRET, cache)
    conn.send((transport.address, transport.register(cache)))
    while (msg := conn.recv()) != "exit":
        t0 = time.perf_counter()
        tags = tagger.tags(list(range(blocks)), msg)
        conn.send((tags, time.perf_counter() - t0))
    transport.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=64, help="blocks a lease (16 tokens each)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=owner, args=(args.blocks, child))
    proc.start()
    address, base = conn.recv()
    transport = make_transport("mooncake")
    cache = torch.zeros(shape(args.blocks), dtype=torch.bfloat16)
    local = transport.register(cache)
    tagger = BlockTagger(SECRET, cache)
    block_bytes = cache[0].numel() * cache.element_size()
    ids = list(range(args.blocks))
    srcs, dsts, lens = pair_regions(base, local, block_bytes, ids, ids)
    nbytes = args.blocks * block_bytes
    runs = []
    for i in range(args.repeat + 1):
        lease = f"lease:{i}"
        conn.send(lease)
        tags, sender_s = conn.recv()
        t0 = time.perf_counter()
        transport.read(address, srcs, dsts, lens)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ok = tagger.verify(ids, lease, tags)
        verify_s = time.perf_counter() - t0
        if not ok:
            raise SystemExit("the tags of an untouched transfer did not match")
        if i:  # the first is a warm-up (the handshake, first touches of the pages)
            runs.append({"read_s": read_s, "sender_tag_s": sender_s, "verify_s": verify_s})
    conn.send("exit")
    proc.join(30)
    transport.close()

    def median(key: str) -> float:
        return sorted(r[key] for r in runs)[len(runs) // 2]

    read, send_tag, verify = median("read_s"), median("sender_tag_s"), median("verify_s")
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "blocks": args.blocks,
        "block_bytes": block_bytes,
        "bytes": nbytes,
        "read_s": read,
        "sender_tag_s": send_tag,
        "verify_s": verify,
        "gbps_without_tags": nbytes / read / 1e9,
        "gbps_with_tags": nbytes / (read + send_tag + verify) / 1e9,
        "tag_gbps": nbytes / verify / 1e9,
        "runs": runs,
    }
    print(
        f"{result['machine']}: {args.blocks} blocks of {block_bytes / 2**20:.0f} MiB over loopback"
    )
    print("| read s | sender tags s | receiver tags s | GB/s without tags | GB/s with tags |")
    print("|---|---|---|---|---|")
    print(
        f"| {read:.3f} | {send_tag:.3f} | {verify:.3f} | {result['gbps_without_tags']:.2f} | "
        f"{result['gbps_with_tags']:.2f} |"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
