"""The hint index's connection cap under a burst, on a real redis-server: never more connections
than `max_connections`, a lookup that finds them all busy answers "nobody" at once (no error, no
backoff), writes wait for a connection and all land, and the truth is answered after."""

from __future__ import annotations

import asyncio

import redis

from kvfleet_runtime.fleet.hint_index import RedisHintIndex
from tests.runtime.fleet.conftest import RedisProcess

CHAIN = [bytes([i]) * 16 for i in range(100)]
CAP = 3


def _connections_received(server: RedisProcess) -> int:
    with redis.Redis.from_url(server.url, socket_timeout=5) as client:
        return int(client.info("stats")["total_connections_received"])


async def test_a_burst_stays_within_the_connection_cap(redis_server: RedisProcess) -> None:
    before = _connections_received(redis_server)
    index = RedisHintIndex.from_url(redis_server.url, max_connections=CAP, lookup_budget_s=2.0,
                                    write_timeout_s=10.0)
    try:
        # 40 publishes at once: they wait for a connection, and every one lands.
        await asyncio.gather(*(index.publish(f"r{i}", CHAIN, tenant="acme") for i in range(40)))
        assert index.stats.num_published == 40 * len(CHAIN) and index.stats.num_errors == 0

        answers = await asyncio.gather(
            *(index.lookup_runs(CHAIN, tenant="acme") for _ in range(300)))
        truth = {f"r{i}": len(CHAIN) for i in range(40)}
        assert all(a in (truth, {}) for a in answers)
        assert truth in answers and index.stats.num_busy > 0
        assert index.stats.num_errors == 0 and index.available  # saturated is not broken

        # The cap held: the index opened at most CAP connections for all of it (the +1 is
        # this test's own INFO connection).
        assert _connections_received(redis_server) - before <= CAP + 1
        assert await index.lookup_runs(CHAIN, tenant="acme") == truth
    finally:
        await index.close()


async def test_a_lookup_cut_short_by_its_budget_keeps_its_connection(
    redis_server: RedisProcess,
) -> None:
    now = [0.0]
    index = RedisHintIndex.from_url(redis_server.url, max_connections=CAP, lookup_budget_s=2.0,
                                    write_timeout_s=10.0, monotonic=lambda: now[0])
    try:
        await index.publish("r1", CHAIN, tenant="acme")
        assert await index.lookup_runs(CHAIN, tenant="acme") == {"r1": len(CHAIN)}
        opened = _connections_received(redis_server)
        index.lookup_budget_s = 1e-6  # no reply can come back within this
        for _ in range(5):
            assert await index.lookup_runs(CHAIN, tenant="acme") == {}
            now[0] += 60.0  # past the backoff the overrun started
            for _ in range(200):  # the call finishes on its own, and gives its slot back
                if not index._calls:
                    break
                await asyncio.sleep(0.01)
        assert index.stats.num_errors == 5 and not index._calls
        index.lookup_budget_s = 2.0
        assert await index.lookup_runs(CHAIN, tenant="acme") == {"r1": len(CHAIN)}
        # No connection was dropped, so none was opened again; +1: this INFO connection, +1: the
        # warm-up after the first error (SCRIPT LOAD) took a second one while the first was busy.
        assert _connections_received(redis_server) - opened <= 2
    finally:
        await index.close()
