"""Who may act as a tenant on a real replica (127.0.0.1), and who may control its cache.

A secured replica (router secret, operator token, fleet name "r0") and an open one (no secrets:
tenant `default` on loopback only), each a real aiohttp server over the tiny checkpoint. Every
refusal is a 401/403 in OpenAI's error envelope and changes nothing on the replica.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvfleet_runtime.auth import MAX_CLOCK_SKEW_S, sign_assertion
from kvfleet_runtime.server import ReplicaAuth, build_replica, load_config
from kvfleet_runtime.server._auth import _is_loopback
from kvfleet_runtime.wire import ASSERTION_HEADER

from .conftest import TEST_CONFIG, ServerThread

SECRET = b"router-secret-auth-tests"
OPERATOR = b"operator-token-auth-tests"
PROMPT = [(3 * i + 1) % 256 for i in range(40)]


def _serve(model_dir: Path, auth: ReplicaAuth) -> Iterator[str]:
    overrides = {"model_dir": str(model_dir)}
    replica = build_replica(load_config(None, environ={}, overrides={**TEST_CONFIG, **overrides}))
    with ServerThread(replica, auth) as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def secured(model_dir: Path) -> Iterator[str]:
    yield from _serve(model_dir, ReplicaAuth(router_secret=SECRET, operator_token=OPERATOR,
                                             name="r0"))


@pytest.fixture(scope="module")
def open_replica(model_dir: Path) -> Iterator[str]:
    yield from _serve(model_dir, ReplicaAuth())


def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def asserted(tenant: str, *, secret: bytes = SECRET, audience: str = "r0", method: str = "POST",
             path: str = "/v1/completions", now_s: float | None = None) -> dict[str, str]:
    value = sign_assertion(secret, tenant, audience=audience, method=method, path=path,
                           now_s=time.time() if now_s is None else now_s)
    return {"X-Kvfleet-Tenant": tenant, ASSERTION_HEADER: value}


def complete(base: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    return call("POST", base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, headers)


def error_code(result: tuple[int, dict[str, Any]]) -> tuple[int, str]:
    status, body = result
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return status, body["error"]["code"]


def test_the_router_assertion_is_accepted_once(secured: str) -> None:
    headers = asserted("acme")
    status, body = complete(secured, headers)
    assert status == 200 and body["usage"]["prompt_tokens"] == 40
    assert error_code(complete(secured, headers)) == (401, "tenant_assertion_replayed")


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: {"X-Kvfleet-Tenant": "acme"}, (401, "tenant_assertion_missing")),
        (lambda: asserted("acme", secret=b"guessed"), (401, "tenant_assertion_forged")),
        # A genuine assertion for globex, presented as acme: the tenant is under the MAC.
        (lambda: {**asserted("globex"), "X-Kvfleet-Tenant": "acme"},
         (401, "tenant_assertion_forged")),
        (lambda: asserted("acme", path="/v1/chat/completions"), (401, "tenant_assertion_forged")),
        (lambda: asserted("acme", now_s=time.time() - 10 - MAX_CLOCK_SKEW_S - 5),
         (401, "tenant_assertion_expired")),
        (lambda: asserted("acme", audience="r1"), (403, "tenant_assertion_audience")),
        (lambda: {**asserted("acme"), ASSERTION_HEADER: "v1.1.2.3.r0"},
         (401, "tenant_assertion_malformed")),
    ],
    ids=["missing", "forged", "other-tenant", "other-path", "expired", "other-replica",
         "malformed"],
)
def test_forged_expired_missing_and_misdirected_assertions_are_refused(
    secured: str, make: Any, expected: tuple[int, str]
) -> None:
    assert error_code(complete(secured, make())) == expected
    assert complete(secured, asserted("acme"))[0] == 200  # and the replica keeps serving


def _stats(base: str, tenant: str | None, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    query = "" if tenant is None else "?" + urllib.parse.urlencode({"tenant": tenant})
    return call("GET", base + "/cache/stats" + query, headers=headers)


def test_a_tenant_reads_its_own_stats_and_only_the_operator_reads_others(secured: str) -> None:
    assert complete(secured, asserted("globex"))[0] == 200
    own = _stats(secured, "acme", asserted("acme", method="GET", path="/cache/stats"))
    assert own[0] == 200 and own[1]["tenant"] == "acme"
    other = _stats(secured, "globex", asserted("acme", method="GET", path="/cache/stats"))
    assert error_code(other) == (403, "cross_tenant_stats")
    assert error_code(_stats(secured, "globex", {})) == (401, "missing_operator_token")
    assert error_code(_stats(secured, None, {})) == (401, "missing_operator_token")
    # The completion's assertion does not open the stats (method and path are signed).
    assert error_code(_stats(secured, "acme", asserted("acme"))) == (
        401, "tenant_assertion_forged")
    assert error_code(_stats(secured, "globex", {"Authorization": "Bearer guessed"})) == (
        401, "invalid_operator_token")
    operator = {"Authorization": "Bearer " + OPERATOR.decode()}
    status, body = _stats(secured, "globex", operator)
    assert status == 200 and body["tenant"] == "globex" and body["totals"]["num_lookups"] >= 1
    status, body = _stats(secured, None, operator)
    assert status == 200 and body["totals"]["num_lookups"] >= 2


def test_invalidate_needs_the_operator_token(secured: str) -> None:
    url = secured + "/cache/invalidate"
    body = {"model_version": "sha256:" + "ab" * 32}
    assert error_code(call("POST", url, body)) == (401, "missing_operator_token")
    assert error_code(call("POST", url, body, {"Authorization": "Bearer guessed"})) == (
        401, "invalid_operator_token")
    # A tenant's assertion is not the operator's credential.
    tenant = asserted("acme", path="/cache/invalidate")
    assert error_code(call("POST", url, body, tenant)) == (401, "missing_operator_token")
    status, answer = call("POST", url, body, {"Authorization": "Bearer " + OPERATOR.decode()})
    assert (status, answer) == (202, {"model_version": body["model_version"],
                                      "status": "accepted"})


def test_probes_metrics_and_models_stay_open(secured: str) -> None:
    for path in ("/healthz", "/readyz", "/v1/models", "/openapi.json"):
        assert call("GET", secured + path)[0] == 200, path
    with urllib.request.urlopen(secured + "/metrics", timeout=10) as resp:
        assert resp.status == 200
    # Unknown routes and methods keep their 404/405, credentials or not.
    assert call("POST", secured + "/v1/nope", {})[0] == 404
    assert call("GET", secured + "/v1/completions")[0] == 405


def test_an_open_replica_serves_only_the_default_tenant(open_replica: str) -> None:
    status, body = complete(open_replica, {})  # no tenant header: the tenant `default`
    assert status == 200 and body["usage"]["prompt_tokens"] == 40
    assert complete(open_replica, {"X-Kvfleet-Tenant": "default"})[0] == 200
    assert error_code(complete(open_replica, {"X-Kvfleet-Tenant": "acme"})) == (
        403, "tenant_not_allowed")
    # Signed or not: without a router secret there is nothing to check a signature against.
    assert error_code(complete(open_replica, asserted("acme"))) == (403, "tenant_not_allowed")
    assert _stats(open_replica, None, {})[0] == 200
    assert _stats(open_replica, "default", {})[0] == 200
    assert error_code(_stats(open_replica, "acme", {})) == (403, "operator_token_unset")
    body = {"model_version": "sha256:" + "cd" * 32}
    assert call("POST", open_replica + "/cache/invalidate", body)[0] == 202


@pytest.mark.parametrize(
    ("remote", "loopback"),
    [("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("10.0.0.7", False), ("::ffff:10.0.0.7", False), ("2001:db8::1", False), (None, False),
     ("", False), ("unix-socket", False)],
)
def test_loopback_is_decided_from_the_peer_address(remote: str | None, loopback: bool) -> None:
    assert _is_loopback(remote) is loopback


def test_an_open_replica_refuses_other_peers(model_dir: Path) -> None:
    """The same rule seen from a non-loopback peer address (the middleware reads
    `request.remote`; a test cannot connect from another host, so the app runs behind aiohttp's
    own test transport with a peer address set)."""
    import asyncio

    from aiohttp.test_utils import make_mocked_request

    from kvfleet_runtime.server._auth import DEFAULTED_TENANT, auth_middleware

    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        # the tenant the hook defaulted to, noted on the request (issue 44: not in its headers)
        seen.append(request.get(DEFAULTED_TENANT) or request.headers.get("X-Kvfleet-Tenant", ""))
        return web.json_response({})

    def error(status: int, message: str, **kw: Any) -> web.Response:
        return web.json_response({"error": {"message": message, "code": kw.get("code")}},
                                 status=status)

    middleware = auth_middleware(ReplicaAuth(), error)
    app = web.Application()
    app.router.add_post("/v1/completions", handler)

    async def run(remote: str) -> int:
        class Transport:
            def get_extra_info(self, name: str, default: Any = None) -> Any:
                return (remote, 1234) if name == "peername" else default

            def is_closing(self) -> bool:
                return False

        request = make_mocked_request("POST", "/v1/completions", app=app,
                                      transport=Transport())
        match = await app.router.resolve(request)
        match.add_app(app)
        request._match_info = match
        return (await middleware(request, handler)).status

    assert asyncio.run(run("10.0.0.7")) == 403
    assert asyncio.run(run("127.0.0.1")) == 200
    assert seen == ["default"]
