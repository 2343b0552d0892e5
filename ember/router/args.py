"""Command-line options of `ember router` (kept apart so `ember --help` stays light)."""

from __future__ import annotations

import argparse
import os

from ember.edge_limits import add_connection_limit_args


def add_router_args(p: argparse.ArgumentParser) -> None:
    """`ember router`'s flags, in the groups its --help shows."""
    g = p.add_argument_group("engines", "the engines behind the router, and their model")
    g.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill engines")
    g.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode engines")
    g.add_argument("--both", nargs="*", default=[], metavar="URL", help="colocated engines")
    g.add_argument(
        "--model",
        default=None,
        help="the engines' model directory: its tokenizer and chat template let the router "
        "hash prompts for prefix-aware routing (without it, only load and affinity count)",
    )

    g = p.add_argument_group("server", "where the router listens, and how it logs")
    g.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    g.add_argument("--port", type=int, default=8000, help="the port to listen on")
    g.add_argument("--log-level", default="info", help="debug | info | warning | error")

    g = p.add_argument_group("security", "API keys, tenants and the cluster secret")
    env_key = os.environ.get("EMBER_API_KEY")
    g.add_argument(
        "--api-key",
        nargs="+",
        default=[env_key] if env_key else [],
        metavar="KEY",
        help="API keys for /v1/* (each its own tenant with its own prefix cache; default: "
        "$EMBER_API_KEY)",
    )
    g.add_argument(
        "--api-keys-file",
        default=None,
        metavar="FILE",
        help='API keys and their tenants: JSON {"key": "tenant"} or lines "KEY TENANT [GROUP]"',
    )
    g.add_argument(
        "--shared-cache",
        action="store_true",
        help="let all tenants share one prefix cache (off: each tenant's blocks are its own)",
    )
    g.add_argument(
        "--cluster-secret",
        default=None,
        help="the secret ember's processes share: sent to the engines on every internal call "
        "and required on the router's /load and /metrics (default: $EMBER_CLUSTER_SECRET)",
    )
    g.add_argument(
        "--public-metrics", action="store_true", help="serve /metrics without the cluster secret"
    )

    g = p.add_argument_group("routing", "which engine gets a request, and when a stream is dead")
    g.add_argument(
        "--disagg-min-uncached",
        type=int,
        default=256,
        help="prompts with fewer uncached tokens go whole to a decode engine (not a session's: "
        "with x-session-affinity or x-session-id, every turn prefills on the session's engine)",
    )
    g.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /load polls")
    g.add_argument(
        "--affinity-epsilon",
        type=float,
        default=0.25,
        help="a session's endpoint keeps it unless its load exceeds (1 + eps) x the mean",
    )
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="end a stream with an error event when its engine sends nothing for S seconds",
    )

    g = p.add_argument_group("limits", "what one client or request may take of the router")
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 << 20,
        help="larger request bodies are refused with 413",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="close a connection that has not sent a whole request head within S seconds (and "
        "an idle keep-alive connection after S seconds)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="client connections held at once; more are closed as they arrive",
    )
    add_connection_limit_args(g)
