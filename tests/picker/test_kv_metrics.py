"""The router's Prometheus series of its KV event views (`picker._kv_metrics`): read from the
views at each scrape (blocks held, events applied, drops by reason, unplaced blocks), and served
on the router's own /metrics next to its other series, fed by a real ZMQ publisher."""

from __future__ import annotations

import asyncio

import aiohttp
import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_runtime.affinity import ApiKeyMap
from kvfleet_runtime.picker import FleetView, KvEventViews
from kvfleet_runtime.picker._kv_events import AllBlocksCleared
from kvfleet_runtime.picker._kv_metrics import DROP_REASONS, KvEventCollector
from kvfleet_runtime.router import RouterState, create_router_app
from tests.picker.test_kv_events import B, batch, stored, tokens
from tests.picker.test_kv_subscriber import Publisher
from tests.picker.test_kv_subscriber import stored as wire_stored
from tests.support import free_port

Key = tuple[str, tuple[tuple[str, str], ...]]


def key(name: str, **labels: str) -> Key:
    return name, tuple(sorted(labels.items()))


def test_the_series_read_each_view() -> None:
    views: KvEventViews | None = None
    registry = CollectorRegistry()
    registry.register(KvEventCollector(lambda: views))
    sample = registry.get_sample_value
    # not subscribed: the families exist, with no series
    assert sample("kvfleet_router_kv_view_blocks", {"replica": "a"}) is None

    views = KvEventViews()
    a, b = views.view("a"), views.view("b")
    p = tokens(3 * B)
    a.apply(0, batch(stored([10, 11], None, p[:2 * B]), stored([12], 99, p[2 * B:])))
    b.apply(0, batch(stored([20], None, p[:B])))
    b.apply(3, batch())  # 1 and 2 were lost
    b.apply(0, batch(stored([21], None, p[:B])))  # restarted
    assert sample("kvfleet_router_kv_view_blocks", {"replica": "a"}) == 2
    assert sample("kvfleet_router_kv_view_blocks", {"replica": "b"}) == 1
    # a batch of two events, then one; the one whose parent is unknown is counted, not placed
    assert sample("kvfleet_router_kv_events_total", {"replica": "a"}) == 2
    assert sample("kvfleet_router_kv_unplaced_blocks_total", {"replica": "a"}) == 1
    assert sample("kvfleet_router_kv_events_total", {"replica": "b"}) == 2
    for reason in DROP_REASONS:
        want = 1 if reason in ("gap", "restart") else 0
        assert sample("kvfleet_router_kv_view_drops_total",
                      {"replica": "b", "reason": reason}) == want, reason
    assert set(DROP_REASONS) == {"gap", "restart", "malformed", "overflow", "disconnected",
                                 "cleared"}

    a.malformed(1)
    a.disconnected()
    a.apply(0, batch(stored([10], None, p[:B])))
    a.apply(1, batch(AllBlocksCleared()))
    for reason in ("malformed", "disconnected", "cleared"):
        assert sample("kvfleet_router_kv_view_drops_total",
                      {"replica": "a", "reason": reason}) == 1, reason
    assert sample("kvfleet_router_kv_view_blocks", {"replica": "a"}) == 0
    # the scrape reads the views now: a forgotten replica's series end
    views.forget(["b"])
    assert sample("kvfleet_router_kv_view_blocks", {"replica": "b"}) is None


async def test_the_routers_metrics_show_its_kv_event_views() -> None:
    """A router subscribed to one replica's KV events (a real PUB socket on loopback, vLLM's
    framing): its /metrics says what the view holds, how many events it applied, and that a
    sequence gap dropped it."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    port = free_port()
    pub = Publisher(ctx, port)
    state = RouterState(view=FleetView(static_replicas={"a": "http://127.0.0.1:1"}),
                        keys=ApiKeyMap({}), poll_interval_s=3600, kv_events=KvEventViews(),
                        kv_event_endpoints={"a": f"tcp://127.0.0.1:{port}"})
    runner = web.AppRunner(create_router_app(state))
    await runner.setup()
    http_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()

    async def scrape(client: aiohttp.ClientSession) -> dict[Key, float]:
        async with client.get(f"http://127.0.0.1:{http_port}/metrics") as r:
            assert r.status == 200
            text = await r.text()
        return {key(s.name, **s.labels): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    async def until(client: aiohttp.ClientSession, series: Key,
                    value: float) -> dict[Key, float]:
        for _ in range(200):
            got = await scrape(client)
            if got.get(series) == value:
                return got
            await asyncio.sleep(0.05)
        raise AssertionError(f"{series} never {value}: {got.get(series)}")

    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(200):  # PUB drops what it sends before the SUB has joined
                pub.send(seq=0)
                await asyncio.sleep(0.05)
                v = state.kv_events.views.get("a") if state.kv_events else None
                if v is not None and v.last_seq == 0:
                    break
            p = list(range(64))
            pub.send(wire_stored(10, None, p[:32]), seq=1)
            pub.send(wire_stored(11, 10, p[32:]))
            gap = key("kvfleet_router_kv_view_drops_total", replica="a", reason="gap")
            got = await until(client, key("kvfleet_router_kv_view_blocks", replica="a"), 2)
            assert got[key("kvfleet_router_kv_events_total", replica="a")] == 2
            assert got[gap] == 0
            # the router's other series are served beside them
            assert key("kvfleet_router_unauthorized_total") in got
            pub.send(seq=9)  # 3 to 8 lost
            got = await until(client, gap, 1)
            assert got[key("kvfleet_router_kv_view_blocks", replica="a")] == 0
    finally:
        await runner.cleanup()
        pub.close()
        ctx.destroy(linger=0)
