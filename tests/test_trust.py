"""ember.trust on its own: the cluster secret, signed KV parameters, API keys and tenants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.trust import (
    INTERNAL_HEADER,
    SECRET_ENV,
    TENANT_HEADER,
    Tenant,
    TenantKeys,
    bearer_token,
    cache_namespace,
    internal_headers,
    is_internal,
    resolve_secret,
    sign_kv_params,
    verify_kv_params,
)


def test_secret_from_flag_env_or_random(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert resolve_secret("s1") == ("s1", True)
    monkeypatch.setenv(SECRET_ENV, "s2")
    assert resolve_secret(None) == ("s2", True)
    assert resolve_secret("s1") == ("s1", True)  # the flag wins
    monkeypatch.delenv(SECRET_ENV)
    a, configured = resolve_secret(None)
    b, _ = resolve_secret(None)
    assert not configured and len(a) >= 32 and a != b  # closed: nobody can guess it


def test_internal_headers_prove_the_secret() -> None:
    h = internal_headers("s", "tenant-a")
    assert h == {INTERNAL_HEADER: "s", TENANT_HEADER: "tenant-a"}
    assert is_internal(h, "s")
    assert not is_internal(h, "other")
    assert not is_internal({}, "s")
    assert not is_internal({INTERNAL_HEADER: ""}, "")  # an empty secret never matches


PARAMS = {
    "engine_id": "e1",
    "lease_id": "e1:r1",
    "block_ids": [3, 4, 5],
    "transfer_address": "127.0.0.1:9000",
    "kv_base_addr": 140000000000,
    "block_bytes": 4096,
    "first_token_id": 7,
    "lease_s": 30.0,
    "release_url": "http://127.0.0.1:8001/kv/release",
}


def test_signed_params_verify_and_flags_do_not_count() -> None:
    signed = {**PARAMS, "signature": sign_kv_params("s", PARAMS)}
    assert verify_kv_params("s", signed)
    # The router turns a prefill answer into a decode request by setting the flags.
    assert verify_kv_params("s", {**signed, "do_remote_prefill": True, "do_remote_decode": False})
    assert not verify_kv_params("other", signed)
    assert not verify_kv_params("s", PARAMS)  # unsigned
    assert not verify_kv_params("s", {**PARAMS, "signature": ""})
    assert not verify_kv_params("s", {**PARAMS, "signature": 5})


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_ids", [3, 4, 6]),
        ("release_url", "http://evil.example/kv/release"),
        ("transfer_address", "10.0.0.9:9000"),
        ("kv_base_addr", 0),
        ("first_token_id", 8),
    ],
)
def test_any_altered_field_breaks_the_signature(field: str, value: object) -> None:
    signed = {**PARAMS, "signature": sign_kv_params("s", PARAMS)}
    assert not verify_kv_params("s", {**signed, field: value})


def test_bearer_scheme_is_case_insensitive() -> None:
    assert bearer_token("Bearer k") == "k"
    assert bearer_token("bearer k") == "k"
    assert bearer_token("BEARER   k ") == "k"
    assert bearer_token("Basic k") == ""
    assert bearer_token(None) == ""


def test_each_api_key_is_its_own_tenant() -> None:
    keys = TenantKeys.load(["ka", "kb", " "])
    assert keys.enabled and len(keys.keys) == 2
    a, b = keys.lookup("Bearer ka"), keys.lookup("bearer kb")
    assert a is not None and b is not None and a != b
    assert "ka" not in a.name  # the tenant's name does not give the key away
    assert keys.namespace(a) != keys.namespace(b) and keys.namespace(a)
    assert keys.lookup("Bearer kc") is None and keys.lookup(None) is None
    assert keys.lookup("Bearer ") is None
    assert not TenantKeys.load().enabled


def test_shared_cache_puts_every_tenant_in_one_namespace() -> None:
    keys = TenantKeys.load(["ka", "kb"], shared_cache=True)
    assert {keys.namespace(keys.lookup(f"Bearer {k}")) for k in ("ka", "kb")} == {""}


def test_keys_file_json(tmp_path: Path) -> None:
    f = tmp_path / "keys.json"
    f.write_text(
        json.dumps(
            {"k1": "acme", "k2": {"tenant": "initech", "cache_group": "shared"}, "k3": "acme"}
        )
    )
    keys = TenantKeys.load(["k0"], keys_file=str(f))
    assert keys.lookup("Bearer k1") == Tenant("acme", "acme")
    assert keys.lookup("Bearer k3") == Tenant("acme", "acme")  # two keys, one tenant
    assert keys.lookup("Bearer k2") == Tenant("initech", "shared")
    assert keys.lookup("Bearer k0") is not None  # --api-key and the file add up


def test_keys_file_lines(tmp_path: Path) -> None:
    f = tmp_path / "keys.txt"
    f.write_text("# key tenant [cache group]\nk1 acme\n\nk2 initech shared  # a comment\n")
    keys = TenantKeys.load(keys_file=str(f))
    assert keys.lookup("Bearer k1") == Tenant("acme", "acme")
    assert keys.lookup("Bearer k2") == Tenant("initech", "shared")
    assert len(keys.keys) == 2


@pytest.mark.parametrize(
    "text,match",
    [
        ("k1\n", "KEY TENANT"),
        ("k1 a b c\n", "KEY TENANT"),
        ('{"k1": 5}', "tenant name"),
        ('{"k1": ', "not valid JSON"),
    ],
)
def test_bad_keys_file_is_a_clear_error(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        TenantKeys.load(keys_file=str(f))


def test_missing_keys_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        TenantKeys.load(keys_file=str(tmp_path / "nope"))


def test_cache_namespace_separates_tenants_and_salts() -> None:
    assert cache_namespace(None, None) is None and cache_namespace("", "") is None
    names = {
        cache_namespace("a", None),
        cache_namespace("b", None),
        cache_namespace(None, "a"),
        cache_namespace("a", "x"),
        cache_namespace("a", "y"),
    }
    assert None not in names and len(names) == 5
    # Joined unambiguously: no tenant/salt pair can be spelled as another.
    assert cache_namespace("a,b", "c") != cache_namespace("a", "b,c")
