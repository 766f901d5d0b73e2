"""The router's upstream connection pool under a burst: never more connections to one replica
than `upstream_max_connections_per_replica`, nor to all together than `upstream_max_connections`;
the requests beyond wait for one and all succeed. Real router app, real replicas on loopback,
the pool the router makes itself (no session handed in)."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import aiohttp
import pytest
from aiohttp import web

from kvfleet_runtime.affinity import rendezvous_top_k
from kvfleet_runtime.api import AppRunner
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.router import RouterState, create_router_app
from tests.router.conftest import KEYS
from tests.support import free_port


class CountingReplica:
    """Answers after a pause; counts the connections it was reached on and the most requests
    it had at once (`everywhere`: over all of them together)."""

    everywhere: ClassVar[list[int]] = [0, 0]  # in flight, peak

    def __init__(self, name: str) -> None:
        self.name = name
        self.ports: set[int] = set()
        self.inflight = 0
        self.peak = 0
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def completions(request: web.Request) -> web.StreamResponse:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.ports.add(peer[1] if peer else 0)
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            both = CountingReplica.everywhere
            both[0] += 1
            both[1] = max(both[1], both[0])
            try:
                await asyncio.sleep(0.1)
                return web.json_response({"replica": self.name})
            finally:
                self.inflight -= 1
                both[0] -= 1

        async def ready(request: web.Request) -> web.StreamResponse:
            return web.json_response({"ready": True})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/readyz", ready)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(("per_replica", "total"), [(4, 2048), (4, 6)])
async def test_a_burst_stays_within_the_upstream_caps(per_replica: int, total: int) -> None:
    # Two replicas named so that the two tenants' first homes differ: both take the burst.
    pair = next([f"a{i}", f"b{i}"] for i in range(100)
                if rendezvous_top_k("acme", [f"a{i}", f"b{i}"], 1)
                != rendezvous_top_k("globex", [f"a{i}", f"b{i}"], 1))
    replicas = [CountingReplica(name) for name in pair]
    CountingReplica.everywhere[:] = [0, 0]
    for r in replicas:
        await r.start()
    state = RouterState(
        view=FleetView(static_replicas={r.name: r.url for r in replicas}, k=2),
        keys=KEYS, poll_interval_s=3600, upstream_max_connections=total,
        upstream_max_connections_per_replica=per_replica,
    )
    runner = AppRunner(create_router_app(state))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:

            async def one(i: int) -> int:
                key = "sk-acme" if i % 2 else "sk-globex"  # two tenants: both replicas busy
                async with client.post(f"http://127.0.0.1:{port}/v1/completions",
                                       json={"prompt": "hi", "max_tokens": 1},
                                       headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(one(i) for i in range(60)))
        assert statuses == [200] * 60
        assert all(r.peak == per_replica for r in replicas) or total < 2 * per_replica
        assert max(r.peak for r in replicas) <= per_replica
        assert 1 < CountingReplica.everywhere[1] <= total
        if total >= 2 * per_replica:
            # Nothing but the per-replica cap binds: the connections are reused, never more made.
            assert all(len(r.ports) <= per_replica for r in replicas), [r.ports for r in replicas]
    finally:
        await runner.cleanup()
        for r in replicas:
            assert r.runner is not None
            await r.runner.cleanup()


def test_caps_are_checked() -> None:
    with pytest.raises(ValueError, match="upstream connection caps"):
        RouterState(view=FleetView(static_replicas={"r": "http://127.0.0.1:1"}), keys=KEYS,
                    upstream_max_connections=4, upstream_max_connections_per_replica=8)
