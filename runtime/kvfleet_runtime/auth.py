"""Who may act as a tenant on a replica, and who may control its cache: the pure logic.

Three credentials, three secrets (each a Secret the chart generates; see docs/security.md):

- **Tenant assertion** (router -> replica). The router is the only party that may tell a replica
  which tenant a request is for. With every proxied request it sends the tenant in
  `X-Kvfleet-Tenant` and, in `X-Kvfleet-Tenant-Assertion`,

      v1.<expires_ms>.<nonce>.<mac>.<audience>

  where `mac` is hex HMAC-SHA256(router secret, domain | tenant | audience | nonce | expires_ms |
  method | path), `audience` is the name of the replica the router chose, `nonce` 128 random bits
  and `expires_ms` the wall-clock expiry (a few seconds ahead). The replica recomputes the MAC
  (constant-time compare), checks the expiry (with a bounded clock skew and a bounded lifetime),
  its own name against the audience, and remembers the nonce until the expiry (`ReplayCache`):
  the assertion is good for one request, to one replica, for one method and path, for seconds.
  A front that does not send the request itself (`kvfleet epp`: Envoy sends it, and retries on
  the pick's fallbacks) sends one assertion per replica it may reach, comma-separated, each with
  its own audience and nonce (`MAX_ASSERTIONS`); a replica checks the one for its own name, so
  the list is still good at each of those replicas once and nowhere else.
- **Operator token** (operator -> replica): `Authorization: Bearer <token>` on
  `POST /cache/invalidate` and on `GET /cache/stats` for all tenants or a tenant other than the
  caller's. A plain bearer compared in constant time: the operator is one party with one secret.
- **Cache salt** (router -> vLLM replica): vLLM's OpenAI server takes the tenant from the body's
  `cache_salt`, not from a header, so the router overwrites that field with

      <tenant>.<mac>

  where `mac` is the first 32 hex digits (128 bits) of HMAC-SHA256(router secret, domain |
  tenant). Deterministic per tenant, unlike an assertion: vLLM folds the salt into its own block
  hash, so a per-request nonce would make every request miss vLLM's prefix cache. kvfleet's
  connector inside vLLM recomputes the MAC (`verify_cache_salt`) and leaves a request whose salt
  does not verify alone (no load, no store), never filing it under another tenant.
- **Metrics token** (Prometheus -> replica): `Authorization: Bearer <token>` on `GET /metrics`
  adds the per-tenant series (tenant names and their cache figures); without it `/metrics` has
  only fleet-wide series. Its own secret, so the scraper can read and do nothing else.
- **Peer credential** (replica -> replica, T2): `fleet.t2_protocol.peer_token`, a tenant-scoped HMAC
  under the fleet's peer secret; not here.

This module has no I/O besides `read_secret` and takes its clock as an argument; the aiohttp
hooks live in `kvfleet_runtime.server._auth` (replica) and the router.

Errors by kind: `verify_assertion` returns the refusal (`AssertionRefused`, naming why) rather
than raising; bad arguments (an empty secret, a non-positive lifetime) raise ValueError.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvfleet_runtime.wire import ASSERTION_HEADER, CACHE_SALT_FIELD, MAX_CACHE_SALT_CHARS

__all__ = [
    "DEFAULT_ASSERTION_TTL_S",
    "DEFAULT_TENANT",
    "MAX_ASSERTIONS",
    "MAX_ASSERTION_TTL_S",
    "MAX_CLOCK_SKEW_S",
    "MAX_SALTED_TENANT_CHARS",
    "METRICS_TOKEN_ENV",
    "METRICS_TOKEN_FILE",
    "METRICS_TOKEN_FILE_ENV",
    "OPERATOR_TOKEN_ENV",
    "OPERATOR_TOKEN_FILE",
    "OPERATOR_TOKEN_FILE_ENV",
    "ROUTER_SECRET_ENV",
    "ROUTER_SECRET_FILE",
    "ROUTER_SECRET_FILE_ENV",
    "AssertionRefused",
    "ReplayCache",
    "SaltRefused",
    "TenantAssertion",
    "bearer_matches",
    "cache_salt",
    "header_bytes",
    "hint_key",
    "read_metrics_token",
    "read_operator_token",
    "read_router_secret",
    "read_secret",
    "sign_assertion",
    "verify_assertion",
    "verify_cache_salt",
]

DEFAULT_TENANT = "default"
"""The one tenant a replica without a router secret serves (on loopback only: the demo path)."""
DEFAULT_ASSERTION_TTL_S = 10.0
"""How long a minted assertion stays valid: the router sends it at once, so seconds suffice; the
clock skew between router and replica hosts (NTP: milliseconds) must stay well below it."""
MAX_ASSERTION_TTL_S = 60.0
"""A replica refuses assertions that expire later than this from now (plus the skew): it bounds
how long a nonce must be remembered, so the replay cache stays bounded."""
MAX_CLOCK_SKEW_S = 5.0
MAX_ASSERTIONS = 8
"""Most assertions one header may list (the pick and its fallbacks): the replica parses at most
this many entries, whatever the header holds."""
"""Wall-clock difference between router and replica hosts that is tolerated."""

ROUTER_SECRET_ENV = "KVFLEET_ROUTER_SECRET"
ROUTER_SECRET_FILE_ENV = "KVFLEET_ROUTER_SECRET_FILE"
ROUTER_SECRET_FILE = Path("/etc/kvfleet/router-secret/secret")
"""Where the chart mounts the tenant-assertion secret (router and replicas)."""
OPERATOR_TOKEN_ENV = "KVFLEET_OPERATOR_TOKEN"
OPERATOR_TOKEN_FILE_ENV = "KVFLEET_OPERATOR_TOKEN_FILE"
OPERATOR_TOKEN_FILE = Path("/etc/kvfleet/operator-token/token")
METRICS_TOKEN_ENV = "KVFLEET_METRICS_TOKEN"
METRICS_TOKEN_FILE_ENV = "KVFLEET_METRICS_TOKEN_FILE"
METRICS_TOKEN_FILE = Path("/etc/kvfleet/metrics-token/token")
"""Where the chart mounts the operator token (operator and replicas)."""

_DOMAIN = b"kvfleet-tenant-assertion-v1"
_VERSION = "v1"
_NONCE_HEX = 32
_SALT_DOMAIN = b"kvfleet-cache-salt-v1"
_SALT_MAC_HEX = 32
MAX_SALTED_TENANT_CHARS = MAX_CACHE_SALT_CHARS - 1 - _SALT_MAC_HEX
"""The longest tenant name a cache salt can carry (95): vLLM caps `cache_salt` at 128 chars."""

Reason = Literal["missing", "malformed", "forged", "expired", "too_long", "audience", "replayed",
                 "busy"]


def read_secret(environ: Mapping[str, str], env: str, file_env: str, default_file: Path
                ) -> bytes | None:
    """A secret from `env`, else the file named by `file_env`, else `default_file` when it exists;
    None when none is configured. Surrounding whitespace is stripped (a Secret's trailing
    newline). Raises ValueError naming the file when a named file cannot be read."""
    value = environ.get(env, "").strip()
    if value:
        return value.encode()
    named = environ.get(file_env, "")
    path = Path(named) if named else default_file
    if not named and not path.exists():
        return None
    try:
        data = path.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {file_env}={path}: {exc}") from exc
    return data or None


def header_bytes(value: str) -> bytes:
    """A header value as the bytes the client sent. aiohttp hands bytes that are not UTF-8 on
    as lone surrogates (`surrogateescape`), which `str.encode()` refuses with an exception (a
    500); this gives them back, so a MAC or digest over client text never raises and a value
    with such bytes simply does not match (every secret and name here is UTF-8 text)."""
    return value.encode("utf-8", "surrogateescape")


def bearer_matches(authorization: str | None, token: bytes) -> bool:
    """Whether an `Authorization` header value is `Bearer <token>`; constant time in the value."""
    if not authorization or not token:
        return False
    scheme, _, presented = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        header_bytes(presented.strip()), token)


def _mac(secret: bytes, tenant: str, audience: str, nonce: str, expires_ms: int, method: str,
         path: str) -> str:
    # Every part but the secret can come from a request's headers or path: `header_bytes`.
    message = b"\x00".join(header_bytes(part) for part in (
        tenant, audience, nonce, str(expires_ms), method.upper(), path))
    return hmac.new(secret, _DOMAIN + b"\x00" + message, hashlib.sha256).hexdigest()


def sign_assertion(secret: bytes, tenant: str, *, audience: str, method: str, path: str,
                   now_s: float, ttl_s: float = DEFAULT_ASSERTION_TTL_S,
                   nonce: str | None = None) -> str:
    """The `X-Kvfleet-Tenant-Assertion` value for one request of `tenant` to the replica named
    `audience` ("" when the router does not know its name), `method` and `path` (no query)."""
    if not secret:
        raise ValueError("the router secret is empty")
    if "," in audience:
        raise ValueError(f"a replica name cannot hold ',' (assertion lists are comma-separated): "
                         f"{audience[:80]!r}")
    if not 0 < ttl_s <= MAX_ASSERTION_TTL_S:
        raise ValueError(f"ttl_s must be in (0, {MAX_ASSERTION_TTL_S}], got {ttl_s}")
    nonce = secrets.token_hex(_NONCE_HEX // 2) if nonce is None else nonce
    expires_ms = int((now_s + ttl_s) * 1000)
    mac = _mac(secret, tenant, audience, nonce, expires_ms, method, path)
    return f"{_VERSION}.{expires_ms}.{nonce}.{mac}.{audience}"


@dataclass(slots=True, frozen=True)
class TenantAssertion:
    """A verified assertion."""

    tenant: str
    audience: str
    nonce: str
    expires_at_s: float


@dataclass(slots=True, frozen=True)
class AssertionRefused:
    """Why an assertion was refused; `status` is the HTTP status the replica answers."""

    reason: Reason
    message: str

    @property
    def status(self) -> int:
        # 401: the request did not prove it comes from the router (or proved it once already);
        # 403: it did, but for another replica; 503: no room to remember it (retry later).
        return {"audience": 403, "busy": 503}.get(self.reason, 401)


class ReplayCache:
    """Nonces seen and not yet expired, at most `max_entries` of them.

    `admit(nonce, expires_at_s)`: True the first time, False for a nonce already held (a replay),
    None when full of unexpired nonces (no room: the caller refuses the request rather than
    forget a nonce that could then be replayed). Expired nonces are dropped as time passes (their
    assertions are refused by the expiry check anyway). Not thread-safe: one event loop owns it."""

    def __init__(self, max_entries: int, clock: Callable[[], float]) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._clock = clock
        self._expiry_by_nonce: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._expiry_by_nonce)

    def _purge(self, now_s: float) -> None:
        while self._heap and self._heap[0][0] < now_s:
            _, nonce = heapq.heappop(self._heap)
            self._expiry_by_nonce.pop(nonce, None)

    def admit(self, nonce: str, expires_at_s: float) -> bool | None:
        self._purge(self._clock())
        if nonce in self._expiry_by_nonce:
            return False
        if len(self._expiry_by_nonce) >= self.max_entries:
            return None
        self._expiry_by_nonce[nonce] = expires_at_s
        heapq.heappush(self._heap, (expires_at_s, nonce))
        return True


@dataclass(slots=True)
class _Parsed:
    expires_ms: int
    nonce: str
    mac: str
    audience: str


def _parse(value: str) -> _Parsed | None:
    parts = value.split(".", 4)
    if len(parts) != 5 or parts[0] != _VERSION:
        return None
    _, expires, nonce, mac, audience = parts
    if not (expires.isascii() and expires.isdigit() and len(expires) <= 16):
        return None
    if len(nonce) != _NONCE_HEX or len(mac) != 64 or not _is_hex(nonce) or not _is_hex(mac):
        return None
    return _Parsed(int(expires), nonce, mac, audience)


def _own_entry(value: str, own_name: str | None) -> _Parsed | None:
    """The entry of an assertion list addressed to `own_name` (else the first, whose audience
    check then refuses it); None when any entry is malformed or there are too many."""
    entries = value.split(",", MAX_ASSERTIONS)
    if len(entries) > MAX_ASSERTIONS:
        return None
    parsed = [_parse(entry.strip()) for entry in entries]
    if any(p is None for p in parsed):
        return None
    own = [p for p in parsed if p is not None and p.audience == own_name]
    return own[0] if own else parsed[0]


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def verify_assertion(secret: bytes, value: str | None, tenant: str, *, method: str, path: str,
                     own_name: str | None, replays: ReplayCache, now_s: float
                     ) -> TenantAssertion | AssertionRefused:
    """Check an assertion for `tenant` on this request; the nonce is remembered only when every
    other check passed (a forged assertion cannot fill the replay cache). `own_name` None: this
    replica does not know its fleet name, so the audience is not checked."""
    if not value:
        return AssertionRefused("missing", f"missing {ASSERTION_HEADER}: tenant requests are "
                                "accepted only from the router")
    parsed = _own_entry(value, own_name)
    if parsed is None:
        return AssertionRefused("malformed", f"{ASSERTION_HEADER} is not "
                                "v1.<expires_ms>.<nonce>.<mac>.<audience>[,...] (at most "
                                f"{MAX_ASSERTIONS})")
    expected = _mac(secret, tenant, parsed.audience, parsed.nonce, parsed.expires_ms, method, path)
    if not hmac.compare_digest(parsed.mac, expected):
        return AssertionRefused("forged", f"{ASSERTION_HEADER} does not verify for tenant "
                                f"{tenant[:80]!r} on {method.upper()} {path[:200]}")
    expires_at_s = parsed.expires_ms / 1000
    if expires_at_s + MAX_CLOCK_SKEW_S < now_s:
        return AssertionRefused("expired", f"{ASSERTION_HEADER} expired "
                                f"{now_s - expires_at_s:.1f} s ago")
    if expires_at_s > now_s + MAX_ASSERTION_TTL_S + MAX_CLOCK_SKEW_S:
        return AssertionRefused("too_long", f"{ASSERTION_HEADER} expires "
                                f"{expires_at_s - now_s:.0f} s from now; at most "
                                f"{MAX_ASSERTION_TTL_S:.0f} s are accepted")
    if own_name is not None and parsed.audience != own_name:
        return AssertionRefused("audience", f"{ASSERTION_HEADER} is for replica "
                                f"{parsed.audience[:80]!r}, this is {own_name!r}")
    # Remembered past the skew too: an assertion stays acceptable until expiry + skew.
    admitted = replays.admit(parsed.nonce, expires_at_s + MAX_CLOCK_SKEW_S)
    if admitted is None:
        return AssertionRefused("busy", "too many tenant assertions in flight; retry")
    if not admitted:
        return AssertionRefused("replayed", f"{ASSERTION_HEADER} was already used")
    return TenantAssertion(tenant, parsed.audience, parsed.nonce, expires_at_s)


def _salt_mac(secret: bytes, tenant: str) -> str:
    mac = hmac.new(secret, _SALT_DOMAIN + b"\x00" + tenant.encode(), hashlib.sha256)
    return mac.hexdigest()[:_SALT_MAC_HEX]


def cache_salt(secret: bytes | None, tenant: str) -> str:
    """vLLM's `cache_salt` for `tenant`: `<tenant>.<mac>`, the same for every request of the
    tenant (so vLLM's own prefix cache hits across them); the bare tenant when there is no
    secret (a loopback deployment, whose connector has no secret either). The tenant may hold
    '.': the MAC never does, so the last '.' splits. Raises ValueError for a tenant a salt
    cannot carry (empty, or longer than MAX_SALTED_TENANT_CHARS)."""
    if not tenant:
        raise ValueError("the tenant of a cache salt is empty")
    if len(tenant) > MAX_SALTED_TENANT_CHARS:
        raise ValueError(f"tenant {tenant[:40]!r}... has {len(tenant)} characters; a vLLM "
                         f"{CACHE_SALT_FIELD} carries at most {MAX_SALTED_TENANT_CHARS}")
    if not secret:
        return tenant
    return f"{tenant}.{_salt_mac(secret, tenant)}"


SaltReason = Literal["missing", "malformed", "forged"]


@dataclass(slots=True, frozen=True)
class SaltRefused:
    """Why a cache salt names no tenant (the connector then bypasses the request)."""

    reason: SaltReason
    message: str


def verify_cache_salt(secret: bytes, salt: str | None) -> str | SaltRefused:
    """The tenant a salt minted by `cache_salt(secret, tenant)` names, or why it names none."""
    if not salt:
        return SaltRefused("missing", f"no {CACHE_SALT_FIELD}: with a salt secret every request "
                           "must come through the router, which sets one")
    tenant, dot, mac = salt.rpartition(".")
    if not dot or not tenant or len(mac) != _SALT_MAC_HEX or not _is_hex(mac):
        return SaltRefused("malformed", f"{CACHE_SALT_FIELD} {salt[:80]!r} is not "
                           "<tenant>.<mac>")
    if not hmac.compare_digest(mac, _salt_mac(secret, tenant)):
        return SaltRefused("forged", f"{CACHE_SALT_FIELD} for tenant {tenant[:80]!r} does not "
                           "verify under the salt secret")
    return tenant


_HINT_KEY_DOMAIN = b"kvfleet-hint-key-v1"


def hint_key(router_secret: bytes | None) -> bytes | None:
    """The key that names blocks in the hint index (`fleet.hint_index.keyed_digest`), derived
    from the router secret: routers, replicas and vLLM pods (whose connector verifies salts
    with it) all hold that secret, Redis never does. A subkey, domain-separated: the hint key
    reveals nothing of the secret that signs tenants. Rotating the router secret rotates it
    (hints published under the old key are never found again and expire: recomputes, never a
    wrong answer). None without a router secret."""
    if not router_secret:
        return None
    return hmac.digest(router_secret, _HINT_KEY_DOMAIN, "sha256")


def read_router_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The tenant-assertion secret: `KVFLEET_ROUTER_SECRET`, `KVFLEET_ROUTER_SECRET_FILE` or the
    chart's mounted file; None when none is configured."""
    return read_secret(os.environ if environ is None else environ, ROUTER_SECRET_ENV,
                       ROUTER_SECRET_FILE_ENV, ROUTER_SECRET_FILE)


def read_operator_token(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The operator token: `KVFLEET_OPERATOR_TOKEN`, `KVFLEET_OPERATOR_TOKEN_FILE` or the chart's
    mounted file; None when none is configured."""
    return read_secret(os.environ if environ is None else environ, OPERATOR_TOKEN_ENV,
                       OPERATOR_TOKEN_FILE_ENV, OPERATOR_TOKEN_FILE)


def read_metrics_token(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The scrape token: `KVFLEET_METRICS_TOKEN`, `KVFLEET_METRICS_TOKEN_FILE` or the chart's
    mounted file; None when none is configured (then no scrape sees per-tenant series)."""
    return read_secret(os.environ if environ is None else environ, METRICS_TOKEN_ENV,
                       METRICS_TOKEN_FILE_ENV, METRICS_TOKEN_FILE)
