"""Limits that both public faces (`ember serve` and `ember router`) put on a client's connections
and request heads, as flags with the same names and defaults. Imports nothing from ember."""

from __future__ import annotations

import argparse

DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 512


def add_connection_limit_args(p: argparse._ActionsContainer) -> None:
    """Limits that `ember serve` and `ember router` share (each public face has them)."""
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        metavar="N",
        help="connections one client address may hold open; more get 503 or are closed",
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=DEFAULT_MAX_HEADER_BYTES,
        metavar="BYTES",
        help="a request head (request line and headers) longer than this is refused with 431",
    )
    p.add_argument(
        "--max-headers",
        type=int,
        default=DEFAULT_MAX_HEADERS,
        metavar="N",
        help="a request with more header lines than this is refused",
    )
