"""Who a request is for, and how a replica learns it: the one module both fronts call.

    API key -> tenant        `Authorization: Bearer <key>` looked up by digest
                             (`affinity.api_keys`); a missing or unknown key is a 401 in OpenAI's
                             envelope
    tenant -> replica        `X-Kvfleet-Tenant` with a signed assertion bound to the replica,
                             method and path, for seconds (`kvfleet_runtime.auth`); one per
                             replica the request may reach, when the gateway fails over
    tenant -> vLLM body      the body re-encoded with `cache_salt` = the tenant's signed salt,
                             whatever the client sent (vLLM takes the tenant from it)

A client never names its own tenant: a client-sent tenant header is replaced, the API key is not
forwarded, and a client's `cache_salt` is overwritten (else it could name another tenant's salt
and read its cache).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet_runtime.affinity import ApiKeyMap
from kvfleet_runtime.api import ApiError
from kvfleet_runtime.auth import cache_salt, sign_assertion
from kvfleet_runtime.wire import ASSERTION_HEADER, CACHE_SALT_FIELD, TENANT_HEADER

__all__ = ["Tenancy"]


@dataclass(frozen=True, slots=True)
class Tenancy:
    keys: ApiKeyMap
    router_secret: bytes | None = None
    """Signs the tenant assertion and the vLLM salt; None: the tenant goes unsigned and only
    replicas without a router secret (tenant `default`, loopback) accept it."""

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of an `Authorization` header value; ApiError 401 when there is none."""
        tenant = self.keys.tenant_for_authorization(authorization)
        if tenant is None:
            raise ApiError(401, "missing or unknown API key (Authorization: Bearer <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant

    def replica_headers(self, tenant: str, *, replicas: Sequence[str], method: str, path: str,
                        now_s: float) -> dict[str, str]:
        """The headers that carry `tenant` to the replicas the request may reach: the router
        names the one it sends to (one assertion per attempt), the EPP the pick and its
        fallbacks (Envoy retries on them with the same headers; each replica checks its own)."""
        headers = {TENANT_HEADER: tenant}
        if self.router_secret:
            headers[ASSERTION_HEADER] = ",".join(
                sign_assertion(self.router_secret, tenant, audience=replica, method=method,
                               path=path, now_s=now_s) for replica in replicas)
        return headers

    def salt(self, tenant: str) -> str:
        """vLLM's `cache_salt` for `tenant`; ValueError for a tenant a salt cannot carry."""
        return cache_salt(self.router_secret, tenant)

    def vllm_body(self, body: Mapping[str, Any], tenant: str) -> bytes:
        """The body for a vLLM replica: `cache_salt` is the authenticated tenant's salt.
        Re-encoded from the parsed body, so a duplicate `cache_salt` key cannot survive either;
        ApiError 400 for a tenant a salt cannot carry."""
        try:
            salt = self.salt(tenant)
        except ValueError as exc:
            raise ApiError(400, str(exc), code="tenant_not_servable",
                           param=CACHE_SALT_FIELD) from exc
        # parse_json refused lone surrogates, so the text always encodes as UTF-8
        return json.dumps({**body, CACHE_SALT_FIELD: salt}, ensure_ascii=False,
                          separators=(",", ":")).encode()
