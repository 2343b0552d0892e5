"""The trust boundary between ember's public face and its internal one, in one place.

- The cluster secret: ember's own processes (router, engines) prove they are peers by sending it in
  `INTERNAL_HEADER`; internal routes (`/load`, `/kv_events`, `/kv/release`, `/metrics`) and internal
  request fields (`kv_transfer_params`, the tenant header) are honoured only with it.
- KV transfer parameters are signed by the prefill engine that leased the blocks (HMAC-SHA256 under
  the cluster secret), so a decode engine reads only KV that a peer really offered.
- Tenants: each API key belongs to a tenant; a tenant's prefix-cache blocks hash under its own
  namespace (the `cache_namespace` below goes into the first block's hash), so no tenant can hit,
  time or list another's cache.

This module imports nothing from ember: the server, the router, the engine and `ember up` all use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INTERNAL_HEADER = "x-ember-cluster-secret"
"""Carries the cluster secret on every internal call (router -> engine, engine -> engine)."""
TENANT_HEADER = "x-ember-tenant"
"""The tenant a router resolved from the client's API key; engines believe it only with the secret."""
SECRET_ENV = "EMBER_CLUSTER_SECRET"

SIGNED_KV_FIELDS_EXCLUDED = frozenset({"signature", "do_remote_prefill", "do_remote_decode"})

CHECKED_HEADERS = frozenset({
    "authorization", INTERNAL_HEADER, TENANT_HEADER,
    "x-session-affinity", "x-session-id", "x-parent-session-id", "x-request-id",
})  # fmt: skip
"""Headers that decide who a caller is or where its request goes: read from their raw bytes, each
at most once, by both faces (the server and the router) with the same rules."""
MAX_CHECKED_HEADER_BYTES = 4096
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class HeaderError(ValueError):
    """A checked header that is repeated, too long or not text: the request gets a 400."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"header {name} {why}")
        self.header = name


def checked_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's `CHECKED_HEADERS` as text, from the raw (name, value) byte pairs.

    Raises HeaderError for one that is sent twice (two `Authorization` headers: which one counts
    would depend on the server), longer than `MAX_CHECKED_HEADER_BYTES`, not UTF-8, or holding
    control bytes. Values are stripped of surrounding blanks."""
    out: dict[str, str] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name not in CHECKED_HEADERS:
            continue
        if name in out:
            raise HeaderError(name, "is sent more than once")
        if len(value) > MAX_CHECKED_HEADER_BYTES:
            raise HeaderError(name, f"is longer than {MAX_CHECKED_HEADER_BYTES} bytes")
        if _CONTROL.search(value):
            raise HeaderError(name, "holds control characters")
        try:
            out[name] = value.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise HeaderError(name, "is not valid UTF-8") from None
    return out


def new_secret() -> str:
    return secrets.token_hex(32)


def resolve_secret(given: str | None) -> tuple[str, bool]:
    """The cluster secret from a flag or `EMBER_CLUSTER_SECRET`; without either a random one, so
    the internal face is closed to everyone (the second value says whether it was configured)."""
    value = given or os.environ.get(SECRET_ENV) or ""
    if value:
        return value, True
    return new_secret(), False


def is_internal(headers: Mapping[str, str], secret: str) -> bool:
    """Whether a request carries the cluster secret (constant-time compare)."""
    given = headers.get(INTERNAL_HEADER, "")
    return bool(given) and hmac.compare_digest(given.encode(), secret.encode())


def internal_headers(secret: str, tenant: str | None = None) -> dict[str, str]:
    """Headers for a call from one ember process to another."""
    h = {INTERNAL_HEADER: secret}
    if tenant:
        h[TENANT_HEADER] = tenant
    return h


# -- KV transfer parameters --------------------------------------------------------------------


def _canonical(params: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in params.items() if k not in SIGNED_KV_FIELDS_EXCLUDED}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_kv_params(secret: str, params: Mapping[str, Any]) -> str:
    """HMAC-SHA256 over the parameters a prefill engine hands out (flags and signature aside)."""
    return hmac.new(secret.encode(), _canonical(params), hashlib.sha256).hexdigest()


def verify_kv_params(secret: str, params: Mapping[str, Any]) -> bool:
    sig = params.get("signature")
    if not isinstance(sig, str) or not sig:
        return False
    return hmac.compare_digest(sig, sign_kv_params(secret, params))


# -- tenants -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cache_group: str
    """The prefix-cache namespace: the tenant's own name unless the operator groups tenants."""


@dataclass(slots=True)
class TenantKeys:
    """API key -> tenant. Empty: the public face is open and everyone is one (unnamed) tenant."""

    keys: dict[str, Tenant] = field(default_factory=dict)
    shared_cache: bool = False
    """The operator's choice to let all tenants share one prefix cache (off by default)."""

    @classmethod
    def load(
        cls, api_keys: Iterable[str] = (), keys_file: str | None = None, shared_cache: bool = False
    ) -> TenantKeys:
        """`--api-key K [K ...]` (each its own tenant, named by the key's hash) and
        `--api-keys-file F`: JSON `{"key": "tenant"}` or `{"key": {"tenant": t, "cache_group": g}}`,
        or lines `KEY TENANT [CACHE_GROUP]` (# comments)."""
        out: dict[str, Tenant] = {}
        for key in api_keys:
            key = key.strip()
            if key:
                name = "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
                out[key] = Tenant(name, name)
        if keys_file:
            out.update(_read_keys_file(Path(keys_file)))
        return cls(out, shared_cache)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def lookup(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header (scheme case-insensitive), or None.
        Every configured key is compared, in constant time, so timing does not say which matched."""
        key = bearer_token(authorization)
        found: Tenant | None = None
        for k, t in self.keys.items():
            if hmac.compare_digest(k.encode(), key.encode()) and key:
                found = t
        return found

    def namespace(self, tenant: Tenant | None) -> str:
        """The cache group a tenant's blocks hash under ("" when shared or single-tenant)."""
        if tenant is None or self.shared_cache:
            return ""
        return tenant.cache_group


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        return ""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _read_keys_file(path: Path) -> dict[str, Tenant]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read the API keys file {path}: {e}") from e
    out: dict[str, Tenant] = {}
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the API keys file {path} is not valid JSON: {e}") from e
        for key, v in data.items():
            if isinstance(v, str):
                out[key] = Tenant(v, v)
            elif isinstance(v, dict) and isinstance(v.get("tenant"), str):
                out[key] = Tenant(v["tenant"], str(v.get("cache_group") or v["tenant"]))
            else:
                raise ValueError(f"{path}: each key needs a tenant name")
        return out
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"{path}:{n}: expected 'KEY TENANT [CACHE_GROUP]'")
        out[parts[0]] = Tenant(parts[1], parts[2] if len(parts) == 3 else parts[1])
    return out


def cache_namespace(tenant_group: str | None, cache_salt: str | None) -> str | None:
    """The salt that goes into a prompt's first block hash: the tenant's cache group and the
    request's own `cache_salt`, unambiguously joined; None when both are empty (no salt)."""
    if not tenant_group and not cache_salt:
        return None
    return json.dumps([tenant_group or "", cache_salt or ""], separators=(",", ":"))
