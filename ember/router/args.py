"""Command-line options of `ember router` (kept apart so `ember --help` stays light)."""

from __future__ import annotations

import argparse


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill engines")
    p.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode engines")
    p.add_argument("--both", nargs="*", default=[], metavar="URL", help="colocated engines")
    p.add_argument(
        "--model",
        default=None,
        help="the engines' model directory: its tokenizer and chat template let the router "
        "hash prompts for prefix-aware routing (without it, only load and affinity count)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--disagg-min-uncached",
        type=int,
        default=256,
        help="prompts with fewer uncached tokens go whole to a decode engine",
    )
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /load polls")
    p.add_argument(
        "--affinity-epsilon",
        type=float,
        default=0.25,
        help="a session's endpoint keeps it unless its load exceeds (1 + eps) x the mean",
    )
    p.add_argument("--log-level", default="info")
