"""API keys -> tenants. A request never chooses its own tenant: the router derives it from the key.

The keys file (YAML or JSON, usually a mounted Secret) maps each tenant to its keys; a key may be
given in clear or as `sha256:<hex>` of the key, so the file need not hold the secrets themselves:

    tenants:
      acme: ["sk-acme-1", "sha256:9f86d0...15b0f00a08"]
      globex: ["sk-globex-1"]

Only digests are kept in memory. A presented key is hashed and looked up by digest, so the lookup
time does not depend on how much of a stored key it shares. The platform tenant is reserved: no
API key may map to it (platform prefixes are shared by allow-list, never by a caller's claim).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvfleet_runtime.auth import header_bytes
from kvfleet_runtime.wire import PLATFORM_TENANT

__all__ = ["ApiKeyMap", "bearer_token", "load_api_keys", "parse_api_keys"]

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _digest(key: str) -> str:
    # The bytes the client sent (`header_bytes`): a key from a header may hold bytes that are
    # not UTF-8 (lone surrogates here); it then matches no configured key (those are UTF-8).
    return "sha256:" + hashlib.sha256(header_bytes(key)).hexdigest()


@dataclass(slots=True, frozen=True)
class ApiKeyMap:
    digest_to_tenant: Mapping[str, str]

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant of a presented API key, or `None` for an unknown or empty key."""
        if not key:
            return None
        return self.digest_to_tenant.get(_digest(key))

    def tenant_for_authorization(self, header: str | None) -> str | None:
        """The tenant for an `Authorization: Bearer <key>` header value, else `None`."""
        token = bearer_token(header)
        return None if token is None else self.tenant_for_key(token)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self.digest_to_tenant.values())


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def parse_api_keys(data: object, source: str = "<api keys>") -> ApiKeyMap:
    """Validate `{"tenants": {tenant: [key, ...]}}`; raises ValueError naming the bad value."""
    if not isinstance(data, Mapping) or set(data) != {"tenants"}:
        raise ValueError(f"{source}: expected a mapping with exactly one field 'tenants'")
    tenants = data["tenants"]
    if not isinstance(tenants, Mapping):
        raise ValueError(f"{source}: 'tenants' must map tenant -> list of keys")
    digest_to_tenant: dict[str, str] = {}
    for tenant, keys in tenants.items():
        if not isinstance(tenant, str) or not _TENANT_RE.match(tenant) or tenant == PLATFORM_TENANT:
            raise ValueError(f"{source}: invalid tenant name {tenant!r}")
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"{source}: keys of tenant {tenant!r} must be non-empty strings")
        for key in keys:
            digest = key if _DIGEST_RE.match(key) else _digest(key)
            owner = digest_to_tenant.setdefault(digest, tenant)
            if owner != tenant:
                raise ValueError(f"{source}: one key is listed for both {owner!r} and {tenant!r}")
    return ApiKeyMap(digest_to_tenant)


def load_api_keys(path: Path) -> ApiKeyMap:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read API keys file {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML/JSON: {exc}") from exc
    return parse_api_keys(data, str(path))
