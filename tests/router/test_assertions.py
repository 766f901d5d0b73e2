"""The router's tenant assertions, seen by (fake) replicas on 127.0.0.1: one per attempt, for the
replica it was sent to, verifiable with the router secret, never reusable."""

from __future__ import annotations

import time

from kvfleet_runtime.auth import (
    ReplayCache,
    TenantAssertion,
    verify_assertion,
)
from kvfleet_runtime.wire import ASSERTION_HEADER

from .conftest import FakeReplica, StartRouter

SECRET = b"router-secret-router-tests"


async def test_every_forwarded_request_carries_an_assertion_for_its_replica(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas, state={"router_secret": SECRET})
    for _ in range(3):
        status, _headers, _body = await router.post({"prompt": "hi"}, key="sk-acme",
                                                   headers={ASSERTION_HEADER: "v1.forged"})
        assert status == 200
    seen = [(r.name, s["headers"]) for r in replicas for s in r.seen]
    assert len(seen) == 3
    replays = ReplayCache(16, time.time)
    nonces = set()
    for name, headers in seen:
        assert headers["X-Kvfleet-Tenant"] == "acme"
        result = verify_assertion(SECRET, headers[ASSERTION_HEADER], "acme", method="POST",
                                  path="/v1/completions", own_name=name, replays=replays,
                                  now_s=time.time())
        assert isinstance(result, TenantAssertion), result
        nonces.add(result.nonce)
    assert len(nonces) == 3  # the client's header was replaced, and no two requests share one


async def test_a_retry_on_another_replica_gets_its_own_assertion(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    for r in replicas:
        r.status = 503  # every attempt is refused: the router tries max_attempts replicas
    router = await start_router(replicas, state={"router_secret": SECRET})
    status, _headers, _body = await router.post({"prompt": "hi"}, key="sk-globex")
    assert status == 503
    attempts = [(r.name, s["headers"][ASSERTION_HEADER]) for r in replicas for s in r.seen]
    assert len(attempts) == router.state.max_attempts
    assert {value.rsplit(".", 1)[1] for _, value in attempts} == {n for n, _ in attempts}
    assert all(value.endswith("." + name) for name, value in attempts)


async def test_without_a_secret_the_tenant_goes_unsigned(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas)
    assert (await router.post({"prompt": "hi"}, key="sk-acme"))[0] == 200
    (headers,) = [s["headers"] for r in replicas for s in r.seen]
    assert headers["X-Kvfleet-Tenant"] == "acme" and ASSERTION_HEADER not in headers
