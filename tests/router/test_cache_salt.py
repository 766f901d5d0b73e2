"""vLLM replicas take the tenant from the body's `cache_salt`: the router overwrites it in every
body it proxies to one with the authenticated tenant's signed salt, whatever the client sent.
The vLLM replicas here are real HTTP servers on 127.0.0.1 answering vLLM's routes (`/health`,
`/metrics`, the two completion paths) and recording the bodies they receive: the router's wire
contract. kvfleet replicas in the same fleet get the client's body byte for byte."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from aiohttp import web

from kvfleet_runtime.affinity import parse_api_keys
from kvfleet_runtime.auth import (
    MAX_SALTED_TENANT_CHARS,
    SaltRefused,
    cache_salt,
    verify_cache_salt,
)
from kvfleet_runtime.config.fleet import AffinitySettings, FleetConfig, ReplicaEndpoint
from kvfleet_runtime.picker import Tenancy, vllm_load_report
from kvfleet_runtime.wire import CACHE_SALT_FIELD, MAX_CACHE_SALT_CHARS
from tests.support import free_port

from .conftest import FakeReplica, RouterHandle, StartRouter

SECRET = b"router-secret-cache-salt-tests"


@dataclass
class VllmServer:
    """vLLM's OpenAI server as the router sees it: `/health`, no load report, no `/readyz`."""

    name: str
    healthy: bool = True
    metrics: str = ""
    """What `/metrics` answers (vLLM's Prometheus text); empty: 404."""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def health(request: web.Request) -> web.StreamResponse:
            return web.Response(status=200 if self.healthy else 503)

        async def completions(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            self.raw.append(raw)
            body = await request.json()
            self.bodies.append(body)
            return web.json_response({
                "id": "cmpl-1", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model", "tiny"),
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop",
                             "logprobs": None}]})

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            return web.json_response({
                "id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "tiny"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}]})

        async def metrics(request: web.Request) -> web.StreamResponse:
            if not self.metrics:
                return web.Response(status=404)
            return web.Response(text=self.metrics, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def vllm() -> AsyncIterator[VllmServer]:
    server = VllmServer("v0")
    await server.start()
    yield server
    await server.stop()


def _config(vllm: Sequence[VllmServer], kvfleet: Sequence[FakeReplica] = ()) -> FleetConfig:
    return FleetConfig(replicas=(
        *(ReplicaEndpoint(name=v.name, url=v.url, engine="vllm") for v in vllm),
        *(ReplicaEndpoint(name=r.name, url=r.url) for r in kvfleet),
    ))


async def _router(start_router: StartRouter, config: FleetConfig,
                  secret: bytes | None = SECRET) -> RouterHandle:
    router = await start_router([], config=config, state={"router_secret": secret})
    await router.refresh()
    return router


def _client(router: RouterHandle, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


# -- the salt itself (kvfleet_runtime.auth) ------------------------------------------------------


def test_a_salt_names_its_tenant_and_verifies_only_under_its_secret() -> None:
    salt = cache_salt(SECRET, "acme")
    assert salt == cache_salt(SECRET, "acme")  # deterministic: vLLM's own prefix cache hits
    assert salt.startswith("acme.") and len(salt) == len("acme.") + 32
    assert verify_cache_salt(SECRET, salt) == "acme"
    assert cache_salt(SECRET, "globex") != salt
    assert verify_cache_salt(SECRET, cache_salt(SECRET, "team.a.b")) == "team.a.b"
    other = verify_cache_salt(b"another-secret", salt)
    assert isinstance(other, SaltRefused) and other.reason == "forged"
    # another tenant's name with acme's MAC
    swapped = verify_cache_salt(SECRET, "globex." + salt.rpartition(".")[2])
    assert isinstance(swapped, SaltRefused) and swapped.reason == "forged"


@pytest.mark.parametrize(("salt", "reason"), [
    (None, "missing"), ("", "missing"), ("acme", "malformed"), (".%s" % ("0" * 32), "malformed"),
    ("acme." + "0" * 31, "malformed"), ("acme." + "G" * 32, "malformed"),
    ("acme." + "0" * 32, "forged"),
])
def test_a_salt_that_is_not_the_routers_is_refused_by_reason(salt: str | None,
                                                               reason: str) -> None:
    refused = verify_cache_salt(SECRET, salt)
    assert isinstance(refused, SaltRefused) and refused.reason == reason


def test_every_tenant_name_the_router_accepts_fits_vllms_salt_limits() -> None:
    longest = "t" * MAX_SALTED_TENANT_CHARS
    assert len(cache_salt(SECRET, longest)) == MAX_CACHE_SALT_CHARS
    assert not set(cache_salt(SECRET, "a-b_c.d9")) & set("@/\\\x00")
    with pytest.raises(ValueError, match=f"at most {MAX_SALTED_TENANT_CHARS}"):
        cache_salt(SECRET, longest + "t")
    assert cache_salt(None, "acme") == "acme"  # no secret: the bare tenant (loopback)


# -- the router ----------------------------------------------------------------------------------


async def test_vllm_gets_the_authenticated_tenants_salt_never_the_clients(
    vllm: VllmServer, start_router: StartRouter
) -> None:
    router = await _router(start_router, _config([vllm]))
    # Closed here: an unclosed client is collected later, in another test's event loop, and
    # its aclose task fails there ("Event loop is closed").
    async with _client(router, "sk-acme") as acme, _client(router, "sk-globex") as globex:
        # acme names globex's real salt: it must not get globex's cache
        await acme.completions.create(model="tiny", prompt="hi",
                                      extra_body={CACHE_SALT_FIELD: cache_salt(SECRET, "globex")})
        await acme.chat.completions.create(model="tiny",
                                           messages=[{"role": "user", "content": "x"}],
                                           extra_body={CACHE_SALT_FIELD: "globex"})
        await globex.completions.create(model="tiny", prompt="hi")
        await acme.completions.create(model="tiny", prompt="hé ☃ again", max_tokens=3)
    salts = [b[CACHE_SALT_FIELD] for b in vllm.bodies]
    assert salts == [cache_salt(SECRET, "acme")] * 2 + [cache_salt(SECRET, "globex"),
                                                        cache_salt(SECRET, "acme")]
    assert [verify_cache_salt(SECRET, s) for s in salts] == ["acme", "acme", "globex", "acme"]
    # everything else in the body is the client's
    assert vllm.bodies[3] == {"model": "tiny", "prompt": "hé ☃ again", "max_tokens": 3,
                              CACHE_SALT_FIELD: cache_salt(SECRET, "acme")}
    assert vllm.bodies[1]["messages"] == [{"role": "user", "content": "x"}]


async def test_a_duplicate_salt_key_in_the_raw_body_cannot_survive(
    vllm: VllmServer, start_router: StartRouter
) -> None:
    router = await _router(start_router, _config([vllm]))
    raw = b'{"model": "tiny", "prompt": "hi", "cache_salt": "globex", "cache_salt": "globex"}'
    async with router.session.post(router.url + "/v1/completions", data=raw, headers={
            "Authorization": "Bearer sk-acme", "Content-Type": "application/json"}) as r:
        assert r.status == 200
    (forwarded,) = vllm.raw
    assert forwarded.count(b"cache_salt") == 1
    assert vllm.bodies[0][CACHE_SALT_FIELD] == cache_salt(SECRET, "acme")


async def test_kvfleet_replicas_get_the_clients_body_unchanged(
    vllm: VllmServer, start_router: StartRouter
) -> None:
    kvfleet = FakeReplica("k0")
    await kvfleet.start()
    try:
        vllm.healthy = False  # only the kvfleet replica is ready
        router = await _router(start_router, _config([vllm], [kvfleet]))
        body = {"model": "tiny", "prompt": "hi", CACHE_SALT_FIELD: "globex"}
        status, headers, _ = await router.post(body, key="sk-acme")
        assert (status, headers["X-Kvfleet-Replica"]) == (200, "k0")
        assert kvfleet.seen[0]["body"] == body
        assert kvfleet.seen[0]["headers"]["X-Kvfleet-Tenant"] == "acme"
        assert vllm.bodies == []
    finally:
        await kvfleet.stop()


async def test_vllm_readiness_is_its_health_endpoint(
    vllm: VllmServer, start_router: StartRouter
) -> None:
    vllm.healthy = False
    router = await _router(start_router, _config([vllm]))
    status, _, body = await router.post({"model": "tiny", "prompt": "hi"})
    assert (status, body["error"]["code"]) == (503, "no_replica")
    vllm.healthy = True
    await router.refresh()
    status, headers, _ = await router.post({"model": "tiny", "prompt": "hi"})
    assert (status, headers["X-Kvfleet-Replica"]) == (200, "v0")


async def test_without_a_secret_the_salt_is_the_bare_tenant(
    vllm: VllmServer, start_router: StartRouter
) -> None:
    router = await _router(start_router, _config([vllm]), secret=None)
    await router.post({"model": "tiny", "prompt": "hi", CACHE_SALT_FIELD: "globex"})
    assert vllm.bodies[0][CACHE_SALT_FIELD] == "acme"


async def test_a_tenant_too_long_for_a_salt_is_a_clear_400(
    vllm: VllmServer, start_router: StartRouter
) -> None:
    router = await _router(start_router, _config([vllm]))
    long_tenant = "t" * (MAX_SALTED_TENANT_CHARS + 1)
    router.state.tenancy = Tenancy(parse_api_keys({"tenants": {long_tenant: ["sk-long"]}}),
                                   router.state.tenancy.router_secret)
    status, _, body = await router.post({"model": "tiny", "prompt": "hi"}, key="sk-long")
    assert status == 400
    assert body["error"]["code"] == "tenant_not_servable"
    assert body["error"]["param"] == CACHE_SALT_FIELD
    assert f"at most {MAX_SALTED_TENANT_CHARS}" in body["error"]["message"]
    assert vllm.bodies == []


# vLLM 0.33's gauges as its /metrics writes them (prometheus_client's text format), two engines
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-Cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.91
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
"""


def test_a_vllm_replicas_load_is_its_own_gauges() -> None:
    report = vllm_load_report(VLLM_METRICS.encode())
    assert (report.ready, report.kv_occupancy, report.num_waiting, report.num_running) == (
        True, 0.91, 4, 5)
    # OpenMetrics spells the samples vllm_...; garbage and NaN are no load
    om = b'vllm_kv_cache_usage_perc{engine="0"} 0.25\nvllm_num_requests_waiting x\n' \
         b'vllm_num_requests_running{engine="0"} NaN\n'
    assert vllm_load_report(om).kv_occupancy == 0.25
    assert vllm_load_report(om).num_running == 0
    assert vllm_load_report(b"").kv_occupancy == 0.0


async def test_a_full_vllm_home_spills_like_a_kvfleet_replica(start_router: StartRouter) -> None:
    servers = [VllmServer(f"v{i}") for i in range(2)]
    for server in servers:
        await server.start()
    try:
        one_home = _config(servers).model_copy(update={"affinity": AffinitySettings(k=1)})
        router = await _router(start_router, one_home)
        for server in servers:
            server.metrics = VLLM_METRICS.replace("0.91", "0.2")
        await router.refresh()
        home = {(await router.post({"model": "tiny", "prompt": "hi"}))[1]["X-Kvfleet-Replica"]
                for _ in range(3)}
        assert len(home) == 1  # affinity: acme's one home while it has room
        (full,) = home
        next(s for s in servers if s.name == full).metrics = VLLM_METRICS
        await router.refresh()
        assert router.state.view.report(full).kv_occupancy == 0.91  # over the 0.85 threshold
        status, headers, _ = await router.post({"model": "tiny", "prompt": "hi"})
        assert (status, headers["X-Kvfleet-Route"]) == (200, "spill")
        assert headers["X-Kvfleet-Replica"] != full
    finally:
        for server in servers:
            await server.stop()
