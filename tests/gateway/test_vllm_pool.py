"""A pool of vLLM servers behind the gateway: vLLM takes the tenant from the body's `cache_salt`,
so the EPP's answer replaces the body with the authenticated tenant's signed salt (whatever the
client sent), with its new length, in both of Envoy's body modes. The vLLM servers are real HTTP
servers on loopback answering vLLM's routes and recording the bodies they get."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvfleet_lab.gateway import EnvoyGateway
from kvfleet_runtime.auth import cache_salt
from kvfleet_runtime.config.fleet import FleetConfig, ReplicaEndpoint, dump_fleet_config
from kvfleet_runtime.epp import EppState
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.wire import CACHE_SALT_FIELD
from tests.gateway.conftest import EppThread
from tests.router.conftest import KEYS
from tests.router.test_cache_salt import VllmServer

SECRET = b"router-secret-gateway-vllm"


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
async def test_a_vllm_pool_gets_the_tenants_salt_never_the_clients(
        workdir: Path, envoy: Path, mode: str) -> None:
    servers = [VllmServer(f"v{i}") for i in range(2)]
    for s in servers:
        await s.start()
    config = workdir / "fleet.yaml"
    config.write_text(dump_fleet_config(FleetConfig(replicas=tuple(
        ReplicaEndpoint(name=s.name, url=s.url, engine="vllm") for s in servers))))
    with contextlib.ExitStack() as stack:
        state = EppState(view=FleetView(config_path=config), keys=KEYS, router_secret=SECRET,
                         poll_interval_s=0.2)
        epp = stack.enter_context(EppThread(state))
        gw = EnvoyGateway.for_pool(
            workdir / "envoy", epp_address=("127.0.0.1", epp.grpc_port),
            endpoints=[("127.0.0.1", int(s.url.rsplit(":", 1)[1])) for s in servers],
            request_body_mode=mode)
        gw.binary = envoy
        stack.callback(gw.stop)
        gw.start()
        forged = cache_salt(SECRET, "globex")
        async with aiohttp.ClientSession() as session:
            for path in ("/v1/completions", "/v1/chat/completions"):
                body = {"model": "tiny", "prompt": "hi", CACHE_SALT_FIELD: forged,
                        "messages": [{"role": "user", "content": "hi"}]}
                async with session.post(gw.url + path, data=json.dumps(body),
                                        headers={"Authorization": "Bearer sk-acme",
                                                 "Content-Type": "application/json"}) as r:
                    assert r.status == 200, await r.text()
        got = [b for s in servers for b in s.bodies]
        assert len(got) == 2
        assert all(b[CACHE_SALT_FIELD] == cache_salt(SECRET, "acme") for b in got), got
    for s in servers:
        await s.stop()
