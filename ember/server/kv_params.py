"""KV transfer parameters at the engine's edge: parsed, signed when a prefill engine hands them out,
verified before a decode engine reads the KV they point at or calls the URL they name."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import msgspec

from ember.kv_transfer_params import KVTransferParams
from ember.server.errors import APIError
from ember.trust import sign_kv_params, verify_kv_params


def parse_kv_transfer(raw: dict[str, Any] | None) -> KVTransferParams | None:
    """The request's `kv_transfer_params`, checked; None when absent."""
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as e:
        raise APIError(f"kv_transfer_params: {e}", param="kv_transfer_params") from e


def signed_body(params: KVTransferParams, base_url: str, secret: str) -> dict[str, Any]:
    """A prefill leg's answer: where its KV waits and the URL that releases it (this engine's own),
    signed so that a decode engine of the cluster can tell it from a forgery."""
    body = msgspec.to_builtins(params)
    body["release_url"] = base_url.rstrip("/") + "/kv/release"
    body["signature"] = sign_kv_params(secret, body)
    return body


def check_decode_leg(
    params: KVTransferParams | None, secret: str, peers: dict[str, str]
) -> KVTransferParams | None:
    """A decode leg reads KV only where a peer signed it would be, and releases the lease only at
    that peer (with `--kv-peers`, at the configured URL): nothing else is read or called."""
    if params is None or not params.do_remote_prefill:
        return params
    if params.do_remote_decode:
        raise APIError(
            "kv_transfer_params: do_remote_prefill and do_remote_decode exclude each other",
            param="kv_transfer_params",
        )
    if not verify_kv_params(secret, msgspec.to_builtins(params)):
        raise APIError(
            "kv_transfer_params: the signature does not match (not issued by a prefill engine of "
            "this cluster, or altered)",
            403,
            type="authentication_error",
            param="kv_transfer_params",
            code="invalid_kv_signature",
        )
    origin = url_origin(params.release_url)
    if origin is None:
        raise APIError(
            "kv_transfer_params.release_url must be an http(s) URL", param="kv_transfer_params"
        )
    if peers:
        release = peers.get(origin)
        if release is None:
            raise APIError(
                f"kv_transfer_params: {origin} is not one of this engine's --kv-peers",
                403,
                type="authentication_error",
                param="kv_transfer_params",
                code="kv_peer_not_allowed",
            )
        params.release_url = release
    return params


def url_origin(url: str) -> str | None:
    """`scheme://host:port` of an http(s) URL (the port made explicit), or None for anything else."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{u.scheme}://{host}:{port or (443 if u.scheme == 'https' else 80)}"


def kv_peer_urls(peers: list[str] | None) -> dict[str, str]:
    """`--kv-peers URL ...` -> {origin: release URL}; a URL that is not http(s) is an error."""
    out: dict[str, str] = {}
    for url in peers or ():
        origin = url_origin(url)
        if origin is None:
            raise ValueError(f"--kv-peers: {url!r} is not an http(s) URL")
        out[origin] = url.rstrip("/") + "/kv/release"
    return out
