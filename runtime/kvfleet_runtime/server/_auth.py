"""The replica's authentication hook: an aiohttp middleware over `kvfleet_runtime.auth`.

What each route needs (docs/security.md has the reasoning):

    POST /v1/...            X-Kvfleet-Tenant + a tenant assertion from the router for it
    GET  /cache/stats       the operator token; or, for ?tenant=T, an assertion for T
    POST /cache/invalidate  the operator token
    /kv/v1/...              the peer credential (checked by `fleet.t2_serve` itself)
    GET  /metrics           open, without per-tenant series; with them for the metrics token
    everything else         open: probes, /v1/models, /openapi.json, the load report

A replica with no router secret ("open": the demo and a laptop) serves tenant requests only from
loopback and only for the tenant `default` (a request without `X-Kvfleet-Tenant` is `default`);
its cache control is open on loopback unless an operator token is configured. A replica with a
router secret and no operator token refuses cache control altogether.
"""

from __future__ import annotations

import ipaddress
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from kvfleet_runtime.auth import (
    DEFAULT_TENANT,
    AssertionRefused,
    ReplayCache,
    bearer_matches,
    read_metrics_token,
    read_operator_token,
    read_router_secret,
    verify_assertion,
)
from kvfleet_runtime.server._schemas import TENANT_PATTERN
from kvfleet_runtime.wire import ASSERTION_HEADER, TENANT_HEADER

__all__ = ["DEFAULTED_TENANT", "ErrorFactory", "ReplicaAuth", "auth_middleware"]

_TENANT_RE = re.compile(TENANT_PATTERN)
DEFAULT_MAX_NONCES = 200_000
"""Assertions remembered at once: at a 10 s lifetime (+5 s skew), 13k requests/s per replica."""

DEFAULTED_TENANT = web.RequestKey("kvfleet.defaulted_tenant", str)
"""The request key under which the hook notes the tenant of a request that named none (an open
replica serves it as `default`); the handlers read the tenant from there first."""

ErrorFactory = Callable[..., web.Response]
"""`error(status, message, code=..., param=..., headers=...)`: the server's error envelope."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class ReplicaAuth:
    """A replica's credentials. `name` is its fleet name (the assertions' audience); None when it
    does not know it (the audience is then not checked)."""

    router_secret: bytes | None = None
    operator_token: bytes | None = None
    name: str | None = None
    metrics_token: bytes | None = None
    """Shows the per-tenant series on /metrics (`auth.read_metrics_token`); None: nobody."""
    clock: Callable[[], float] = time.time
    """Wall clock (assertion expiries are wall-clock times, shared with the router's host)."""
    max_nonces: int = DEFAULT_MAX_NONCES
    replays: ReplayCache = field(init=False)

    def __post_init__(self) -> None:
        self.replays = ReplayCache(self.max_nonces, self.clock)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReplicaAuth:
        """Secrets from `KVFLEET_ROUTER_SECRET[_FILE]` and `KVFLEET_OPERATOR_TOKEN[_FILE]` (or the
        chart's mounted files), the name from `KVFLEET_FLEET_NAME`, else `POD_NAME`."""
        env = os.environ if environ is None else environ
        name = env.get("KVFLEET_FLEET_NAME") or env.get("POD_NAME") or None
        return cls(router_secret=read_router_secret(env), operator_token=read_operator_token(env),
                   name=name, metrics_token=read_metrics_token(env))

    def sees_tenant_metrics(self, request: web.Request) -> bool:
        """Whether `request` may read per-tenant series: it presents the metrics token; or, on a
        replica with no secrets at all (the laptop), it comes from loopback (as cache control)."""
        if self.metrics_token:
            return bearer_matches(request.headers.get("Authorization"), self.metrics_token)
        return not self.router_secret and _is_loopback(request.remote)

    @property
    def mode(self) -> str:
        return "secured" if self.router_secret else "open (loopback, tenant default only)"


def _is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return False  # a Unix socket or a proxy's name: not provably local
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def auth_middleware(auth: ReplicaAuth, error: ErrorFactory) -> Callable[..., Awaitable[
        web.StreamResponse]]:
    """The middleware; put it inside the server's error middleware."""

    def refuse(status: int, message: str, code: str) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return error(status, message, code=code, headers=headers)

    def open_refusal(request: web.Request, what: str) -> web.Response | None:
        if _is_loopback(request.remote):
            return None
        return refuse(403, f"this replica has no router secret configured: it serves {what} "
                      f"only on loopback (set KVFLEET_ROUTER_SECRET)", "replica_not_secured")

    def operator(request: web.Request) -> web.Response | None:
        """None when the request carries the operator token; else the refusal."""
        token = auth.operator_token
        presented = request.headers.get("Authorization")
        if token and bearer_matches(presented, token):
            return None
        if presented:
            return refuse(401, "operator token invalid", "invalid_operator_token")
        if token is None and not auth.router_secret:
            return open_refusal(request, "cache control")
        if token is None:
            return refuse(403, "cache control needs the operator token, and none is configured "
                          "on this replica (KVFLEET_OPERATOR_TOKEN)", "operator_token_unset")
        return refuse(401, f"{request.method} {request.path} needs the operator token "
                      "(Authorization: Bearer <token>)", "missing_operator_token")

    def tenant(request: web.Request, tenant: str) -> web.Response | None:
        """None when `tenant` is asserted by the router for this request; else the refusal."""
        if not auth.router_secret:
            refusal = open_refusal(request, f"tenant {DEFAULT_TENANT!r}")
            if refusal is not None:
                return refusal
            if tenant != DEFAULT_TENANT:
                return refuse(403, f"this replica has no router secret configured: it serves "
                              f"only tenant {DEFAULT_TENANT!r}, not {tenant[:80]!r}",
                              "tenant_not_allowed")
            return None
        result = verify_assertion(
            auth.router_secret, request.headers.get(ASSERTION_HEADER), tenant,
            method=request.method, path=request.path, own_name=auth.name, replays=auth.replays,
            now_s=auth.clock())
        if isinstance(result, AssertionRefused):
            return refuse(result.status, result.message, f"tenant_assertion_{result.reason}")
        return None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.http_exception is not None:
            return await handler(request)  # no such route or method: the handler's 404/405
        path = request.path
        if path == "/cache/invalidate":
            refusal = operator(request)
        elif path == "/cache/stats":
            asked = request.query.get("tenant")
            caller = request.headers.get(TENANT_HEADER)
            if request.headers.get("Authorization"):
                refusal = operator(request)
            elif caller is not None and asked is not None:
                refusal = tenant(request, caller) if caller == asked else refuse(
                    403, f"tenant {caller[:80]!r} may not read the stats of tenant "
                    f"{asked[:80]!r}", "cross_tenant_stats")
            elif not auth.router_secret and auth.operator_token is None and asked in (
                    None, DEFAULT_TENANT):
                refusal = open_refusal(request, "cache stats")  # one tenant: nothing to cross
            elif not auth.router_secret and auth.operator_token is None:
                refusal = refuse(403, f"this replica serves only tenant {DEFAULT_TENANT!r}; the "
                                 f"stats of {str(asked)[:80]!r} need the operator token, and "
                                 "none is configured", "operator_token_unset")
            else:
                refusal = operator(request)
        elif request.method == "POST" and path.startswith("/v1/"):
            claimed = request.headers.get(TENANT_HEADER)
            if claimed is None and not auth.router_secret:
                refusal = tenant(request, DEFAULT_TENANT)
                if refusal is None:
                    # Noted on the request, not written into its headers: `request.clone`
                    # re-encodes every header, and one with bytes that are not UTF-8 (a
                    # User-Agent, a Cookie) failed that with a 500.
                    request[DEFAULTED_TENANT] = DEFAULT_TENANT
            elif claimed is None or not _TENANT_RE.match(claimed):
                refusal = None  # the handler answers 400 naming the header (no tenant data)
            else:
                refusal = tenant(request, claimed)
        else:
            refusal = None
        if refusal is not None:
            return refusal
        return await handler(request)

    return middleware
