"""Tenants end to end, as deployed: a real `kvfleet router` and a real `kvfleet replica` (fleet
name r0) on 127.0.0.1, both holding the router secret, and a real redis-server that requires a
password (the chart's Redis AUTH).

The router admits a tenant by API key and asserts it to the replica; a client cannot smuggle a
tenant or an assertion through the router; whoever reaches the replica directly cannot act as a
tenant without the router secret; Redis refuses a client without the password, and the
replica and router, given the password in their Redis URL, share hints through it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from kvfleet_runtime.auth import sign_assertion
from kvfleet_runtime.fleet import RedisHintIndex
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.wire import ASSERTION_HEADER
from tests import credentials
from tests.runtime.fleet.conftest import REDIS_SERVER, RedisProcess
from tests.runtime.fleet.test_replicas import _spawn, _wait_ready
from tests.support import free_port

pytestmark = pytest.mark.slow

PASSWORD = "redis-password-under-test"
PROMPT = "Only the router may say which tenant a request is for. " * 3


@dataclass
class World:
    redis: RedisProcess
    replica_url: str
    router_url: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    tmp = tmp_path_factory.mktemp("auth-processes")
    generate_checkpoint(tmp / "tiny", ModelArgs.from_preset("tiny"), seed=0)
    server = RedisProcess(free_port(), tmp, password=PASSWORD)
    server.start()
    procs: list[subprocess.Popen[bytes]] = []
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    try:
        port = free_port()
        replica_url = f"http://127.0.0.1:{port}"
        env = {**base, **credentials.ENV, "KVFLEET_FLEET_NAME": "r0",
               "KVFLEET_PEER_URL": replica_url, "KVFLEET_PEER_SECRET": "peer-secret",
               "KVFLEET_REDIS_URL": server.url, "KVFLEET_REPLICA_CPU_THREADS": "1",
               "KVFLEET_REPLICA_CACHE__ADMIT_MIN_SIGHTINGS": "1"}
        procs.append(_spawn(["replica", "--model-dir", str(tmp / "tiny"), "--port", str(port),
                             "--host", "127.0.0.1", "--model-id", "tiny", "--device", "cpu",
                             "--log-level", "WARNING"], env, tmp / "replica.log"))
        keys = tmp / "keys.json"
        keys.write_text(json.dumps({"tenants": {"acme": ["sk-acme"], "globex": ["sk-globex"]}}))
        router_port = free_port()
        # The Redis URL (with its password) by environment: never in argv (issue 25).
        router_env = {**base, "KVFLEET_ROUTER_SECRET": credentials.ROUTER_SECRET,
                      "KVFLEET_REDIS_URL": server.url}
        procs.append(_spawn(["router", "--keys", str(keys), "--port", str(router_port),
                             "--replica", f"r0={replica_url}",
                             "--recompute-s-per-token", "1e-3", "--poll-interval-s", "0.2",
                             "--log-level", "WARNING"], router_env, tmp / "router.log"))
        router_url = f"http://127.0.0.1:{router_port}"
        _wait_ready(replica_url, procs[0])
        _wait_ready(router_url, procs[1])
        yield World(server, replica_url, router_url)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()


def _via_router(world: World, key: str, headers: dict[str, str] | None = None,
                prompt: str = PROMPT) -> Any:
    r = requests.post(world.router_url + "/v1/completions",
                      json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                      headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=120)
    return r.status_code, r.json()


def _direct(world: World, headers: dict[str, str]) -> tuple[int, Any]:
    r = requests.post(world.replica_url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                      headers=headers, timeout=120)
    return r.status_code, r.json()


def _stats(world: World, tenant: str) -> Any:
    return requests.get(world.replica_url + "/cache/stats", params={"tenant": tenant},
                        headers=credentials.OPERATOR, timeout=10).json()


def test_the_router_asserts_the_tenant_its_api_key_names(world: World) -> None:
    before = _stats(world, "acme")["totals"]["num_lookups"]
    # A client's own tenant header and assertion are dropped: the API key decides.
    smuggled = sign_assertion(credentials.ROUTER_SECRET.encode(), "globex", audience="r0",
                              method="POST", path="/v1/completions", now_s=time.time())
    status, body = _via_router(world, "sk-acme", {"X-Kvfleet-Tenant": "globex",
                                                  ASSERTION_HEADER: smuggled})
    assert status == 200, body
    assert _stats(world, "acme")["totals"]["num_lookups"] == before + 1
    assert _stats(world, "globex")["totals"]["num_lookups"] == 0
    # Many requests, each with its own assertion (no replay refusals on the router's path).
    assert [_via_router(world, "sk-globex")[0] for _ in range(3)] == [200, 200, 200]


def test_a_pod_that_reaches_the_replica_cannot_act_as_a_tenant(world: World) -> None:
    missing = _direct(world, {"X-Kvfleet-Tenant": "acme"})
    assert missing[0] == 401 and missing[1]["error"]["code"] == "tenant_assertion_missing"
    forged = sign_assertion(b"a guess", "acme", audience="r0", method="POST",
                            path="/v1/completions", now_s=time.time())
    status, body = _direct(world, {"X-Kvfleet-Tenant": "acme", ASSERTION_HEADER: forged})
    assert status == 401 and body["error"]["code"] == "tenant_assertion_forged"
    expired = credentials.as_router("acme", world.replica_url + "/v1/completions",
                                    audience="r0")
    # Well past its 10 s lifetime (and the skew): the same assertion, now expired.
    stale = sign_assertion(credentials.ROUTER_SECRET.encode(), "acme", audience="r0",
                           method="POST", path="/v1/completions", now_s=time.time() - 60)
    status, body = _direct(world, {**expired, ASSERTION_HEADER: stale})
    assert status == 401 and body["error"]["code"] == "tenant_assertion_expired"
    first = _direct(world, expired)
    replayed = _direct(world, expired)
    assert (first[0], replayed[0], replayed[1]["error"]["code"]) == (
        200, 401, "tenant_assertion_replayed")
    status, body = _direct(world, credentials.as_router(
        "acme", world.replica_url + "/v1/completions", audience="r1"))
    assert status == 403 and body["error"]["code"] == "tenant_assertion_audience"
    refused = requests.post(world.replica_url + "/cache/invalidate",
                            json={"model_version": "sha256:" + "ab" * 32}, timeout=10)
    assert refused.status_code == 401


def test_redis_refuses_a_client_without_the_password(world: World) -> None:
    anonymous = redis.Redis(host="127.0.0.1", port=world.redis.port)
    try:
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    finally:
        anonymous.close()
    wrong = redis.Redis(host="127.0.0.1", port=world.redis.port, password="guessed")
    try:
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
    finally:
        wrong.close()
    # The replica, with the password in its URL, published its hints (named by keyed digests:
    # it holds the router secret, `auth.hint_key`) and registered itself.
    client = redis.Redis.from_url(world.redis.url)
    try:
        # A publish that times out is dropped (hints are best effort) and a hit publishes
        # nothing new, so each try stores a prompt of its own; on a loaded machine the first
        # may miss its 0.5 s write budget.
        published = False
        for attempt in range(10):
            assert _via_router(world, "sk-acme", prompt=f"{attempt} {PROMPT}")[0] == 200
            polls_left = 30
            while not (published := bool(list(client.scan_iter("kvfleet:k:*")))) and polls_left:
                polls_left -= 1
                time.sleep(0.1)
            if published:
                break
        assert published, "the replica never published a hint (10 prompts, 3 s each)"
        assert client.get("kvfleet:h:r0") == world.replica_url.encode()
    finally:
        client.close()


async def test_the_hint_index_without_the_password_degrades_to_no_hints(world: World) -> None:
    url = f"redis://127.0.0.1:{world.redis.port}/0"
    index = RedisHintIndex.from_url(url, lookup_budget_s=1.0)
    try:
        assert await index.lookup_runs([b"\x01" * 16]) == {}
        assert index.available is False  # backing off after the refusal
    finally:
        await index.close()
