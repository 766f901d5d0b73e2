"""API key -> tenant map: clear and hashed keys, refusal of bad files and of the platform tenant."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvfleet_runtime.affinity import bearer_token, load_api_keys, parse_api_keys


def test_clear_and_hashed_keys(tmp_path: Path) -> None:
    hashed = "sha256:" + hashlib.sha256(b"sk-globex").hexdigest()
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants:\n  acme: [sk-acme-1, sk-acme-2]\n  globex: ['{hashed}']\n")
    keys = load_api_keys(path)
    assert keys.tenant_for_authorization("Bearer sk-acme-2") == "acme"
    assert keys.tenant_for_authorization("bearer  sk-globex ") == "globex"
    assert keys.tenant_for_authorization("Bearer sk-unknown") is None
    assert keys.tenant_for_authorization("Basic sk-acme-1") is None
    assert keys.tenant_for_authorization(None) is None
    assert keys.tenant_for_key(hashed) is None  # the digest itself is not a key
    assert keys.tenants == {"acme", "globex"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tenants": {"__platform__": ["k"]}}, "__platform__"),
        ({"tenants": {"a b": ["k"]}}, "a b"),
        ({"tenants": {"a": "k"}}, "'a'"),
        ({"tenants": {"a": [""]}}, "'a'"),
        ({"tenants": {"a": ["k"], "b": ["k"]}}, "both 'a' and 'b'"),
        ({"tenant": {}}, "exactly one field"),
        ([], "exactly one field"),
    ],
)
def test_bad_files_are_refused(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_api_keys(data)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer x", "x"), ("BEARER  x ", "x"), ("Bearer", None), ("Token x", None), ("", None)],
)
def test_bearer_token(header: str, token: str | None) -> None:
    assert bearer_token(header) == token
