"""Command-line options of `ember router` (kept apart so `ember --help` stays light)."""

from __future__ import annotations

import argparse
import os

from ember.edge_limits import add_connection_limit_args


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
    env_key = os.environ.get("EMBER_API_KEY")
    p.add_argument(
        "--api-key",
        nargs="+",
        default=[env_key] if env_key else [],
        metavar="KEY",
        help="API keys for /v1/* (each its own tenant with its own prefix cache; default: "
        "$EMBER_API_KEY)",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help='API keys and their tenants: JSON {"key": "tenant"} or lines "KEY TENANT [GROUP]"',
    )
    p.add_argument(
        "--shared-cache",
        action="store_true",
        help="let all tenants share one prefix cache (off: each tenant's blocks are its own)",
    )
    p.add_argument(
        "--cluster-secret",
        default=None,
        help="the secret ember's processes share: sent to the engines on every internal call "
        "and required on the router's /load and /metrics (default: $EMBER_CLUSTER_SECRET)",
    )
    p.add_argument(
        "--public-metrics", action="store_true", help="serve /metrics without the cluster secret"
    )
    p.add_argument(
        "--disagg-min-uncached",
        type=int,
        default=256,
        help="prompts with fewer uncached tokens go whole to a decode engine (not a session's: "
        "with x-session-affinity or x-session-id, every turn prefills on the session's engine)",
    )
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /load polls")
    p.add_argument(
        "--affinity-epsilon",
        type=float,
        default=0.25,
        help="a session's endpoint keeps it unless its load exceeds (1 + eps) x the mean",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="end a stream with an error event when its engine sends nothing for S seconds",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 << 20,
        help="larger request bodies are refused with 413",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="close a connection that has not sent a whole request head within S seconds (and "
        "an idle keep-alive connection after S seconds)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="client connections held at once; more are closed as they arrive",
    )
    add_connection_limit_args(p)
    p.add_argument("--log-level", default="info")
