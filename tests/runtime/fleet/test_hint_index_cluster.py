"""The hint index on a real Redis Cluster (three masters, three replicas, AUTH) on loopback:
the contract, one round trip per lookup, a master killed mid-run, a slot migrating while lookups
run."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from kvfleet_lab.fleet.redis_servers import (
    RedisCluster,
    cluster_ports,
    redis_tools_missing,
    running_cluster,
)
from kvfleet_runtime.fleet import HintPublisher, RedisClusterHintIndex
from kvfleet_runtime.fleet.hint_index import tenant_tag
from tests.support import FakeClock

H = [bytes([i]) * 16 for i in range(8)]
PASSWORD = "cluster-secret"


def _start(tmp: Path) -> Iterator[RedisCluster]:
    missing = redis_tools_missing()
    if missing:
        pytest.skip(missing)
    with running_cluster(cluster_ports(6), tmp, password=PASSWORD) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One cluster for the tests that leave its topology as they found it."""
    yield from _start(tmp_path_factory.mktemp("cluster"))


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of its own, for a test that kills a master or moves a slot."""
    yield from _start(tmp_path)


def _index(cluster: RedisCluster, namespace: str, **kwargs: object) -> RedisClusterHintIndex:
    # The contract, not the latency budget, is under test: generous timeouts unless a test says.
    options: dict[str, object] = {"lookup_budget_s": 10.0, "write_timeout_s": 10.0,
                                  "namespace": namespace}
    options.update(kwargs)
    return RedisClusterHintIndex.from_urls(cluster.seed_urls[:2], **options)  # type: ignore[arg-type]


@pytest.fixture
async def index_and_clock(
    cluster: RedisCluster, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[RedisClusterHintIndex, FakeClock]]:
    clock = FakeClock(1000.0)
    index = _index(cluster, request.node.name, ttl_s=60, clock=clock)
    try:
        yield index, clock
    finally:
        await index.close()


def _admin(node_url: str) -> redis.Redis:
    return redis.Redis.from_url(node_url, socket_timeout=5)


async def test_publish_lookup_withdraw_expire(
    index_and_clock: tuple[RedisClusterHintIndex, FakeClock],
) -> None:
    index, clock = index_and_clock
    await index.publish("r1", H[:3], tenant="acme")
    await index.publish("r2", H[:1], tenant="acme")
    assert await index.lookup(H[:4], tenant="acme") == [
        frozenset({"r1", "r2"}), frozenset({"r1"}), frozenset({"r1"}), frozenset()]
    # Published for acme: another tenant's lookup of the same hashes finds nothing.
    assert await index.lookup_runs(H[:3], tenant="globex") == {}
    await index.withdraw("r1", H[1:2], tenant="acme")
    assert await index.lookup_runs(H[:3], tenant="acme") == {"r1": 1, "r2": 1}
    clock.advance(30)
    await index.publish("r2", H[2:3], tenant="acme")
    clock.advance(31)
    assert await index.lookup(H[:3], tenant="acme") == [
        frozenset(), frozenset(), frozenset({"r2"})]
    assert await index.lookup([], tenant="acme") == []
    assert index.stats.num_errors == 0


async def test_lookup_runs_and_host_urls(
    index_and_clock: tuple[RedisClusterHintIndex, FakeClock],
) -> None:
    index, _ = index_and_clock
    await index.publish("r1", H[:5], tenant="t")
    await index.publish("r2", H[:2], tenant="t")
    await index.publish("r2", H[3:5], tenant="t")
    await index.publish("r3", H[1:5], tenant="t")
    assert await index.lookup_runs(H[:6], tenant="t") == {"r1": 5, "r2": 2}
    assert await index.host_url("r1") is None
    await index.register_host("r1", "http://127.0.0.1:1234")
    assert await index.host_url("r1") == "http://127.0.0.1:1234"


async def test_tenants_spread_over_masters_and_a_lookup_is_one_evalsha_on_one(
    cluster: RedisCluster,
) -> None:
    index = _index(cluster, "spread")
    hashes = [i.to_bytes(16, "big") for i in range(125)]  # a 2,000-token prompt
    tenants = [f"tenant-{i}" for i in range(30)]
    admins = {m.port: _admin(m.url) for m in cluster.masters()}
    try:
        for tenant in tenants:
            await index.publish("r1", hashes, tenant=tenant)
        assert await index.lookup_runs(hashes, tenant=tenants[0]) == {"r1": 125}

        def evalsha_calls() -> dict[int, int]:
            out = {}
            for port, admin in admins.items():
                stats = admin.info("commandstats")
                out[port] = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
            return out

        before = evalsha_calls()
        for _ in range(10):
            assert await index.lookup_runs(hashes, tenant=tenants[0]) == {"r1": 125}
        after = evalsha_calls()
        grew = {p: after[p] - before[p] for p in admins if after[p] != before[p]}
        assert list(grew.values()) == [10]  # one master, one call per lookup
        # The tag puts a tenant's chain in one slot; tenants land on every master.
        owners = {cluster.master_of_slot(redis.cluster.key_slot(tenant_tag(t).encode())).port
                  for t in tenants}
        assert owners == set(admins)
    finally:
        for admin in admins.values():
            admin.close()
        await index.close()


async def test_seed_urls_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one seed"):
        RedisClusterHintIndex.from_urls([])
    with pytest.raises(ValueError, match="redis://host:port"):
        RedisClusterHintIndex.from_urls(["http://127.0.0.1:7000"])


def _truth_or_nobody(answer: dict[str, int], truth: dict[str, int]) -> None:
    assert answer in ({}, truth), answer


async def test_a_master_killed_mid_run_answers_nobody_or_the_truth_then_recovers(
    own_cluster: RedisCluster,
) -> None:
    cluster = own_cluster
    index = _index(cluster, "failover", lookup_budget_s=2.0, write_timeout_s=0.5,
                   backoff_s=0.1, max_backoff_s=0.4)
    tenants = [f"tenant-{i}" for i in range(12)]
    truth = {"r1": 4}
    try:
        for tenant in tenants:
            await index.publish("r1", H[:4], tenant=tenant)
            assert await index.lookup_runs(H[:4], tenant=tenant) == truth
        victim_tenant = tenants[0]
        victim = cluster.master_of_slot(redis.cluster.key_slot(tenant_tag(victim_tenant).encode()))
        with _admin(victim.url) as admin:
            assert admin.execute_command("WAIT", 1, 5000) >= 1  # its replica has the keys
        # A tight budget from here on, as in production (2 ms): a slot map refresh must not
        # have to fit in one.
        index.lookup_budget_s = 0.01
        others = [t for t in tenants
                  if cluster.master_of_slot(redis.cluster.key_slot(tenant_tag(t).encode()))
                  is not victim]
        assert others
        victim.kill()
        answered_elsewhere = 0
        deadline = time.monotonic() + 30
        recovered = False
        while time.monotonic() < deadline:
            for tenant in tenants:
                answer = await index.lookup_runs(H[:4], tenant=tenant)  # never raises
                _truth_or_nobody(answer, truth)
                if tenant in others and answer == truth:
                    answered_elsewhere += 1
            if await index.lookup_runs(H[:4], tenant=victim_tenant) == truth:
                recovered = True
                break
            await asyncio.sleep(0.05)
        # The promoted replica answers with the data it had replicated.
        assert recovered, "lookups did not recover after the replica's promotion"
        assert answered_elsewhere > 0  # the other shards kept answering during the outage
        assert index.stats.num_errors >= 1
        await index.publish("r2", H[:2], tenant=victim_tenant)  # writes reach the new master
        assert await index.lookup_runs(H[:4], tenant=victim_tenant) == {"r1": 4, "r2": 2}
    finally:
        await index.close()


def _node_id(node_url: str) -> str:
    with _admin(node_url) as admin:
        node_id = admin.execute_command("CLUSTER", "MYID")
    return node_id.decode() if isinstance(node_id, bytes) else str(node_id)


def _migrate_slot(cluster: RedisCluster, slot: int, stop: threading.Event) -> str:
    """Move `slot` to another master key by key (with pauses, so lookups see it half moved);
    returns the new owner's address."""
    src = cluster.master_of_slot(slot)
    dst = next(m for m in cluster.masters() if m is not src)
    src_id, dst_id = _node_id(src.url), _node_id(dst.url)
    with _admin(src.url) as s, _admin(dst.url) as d:
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while not stop.is_set():
            keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1)
            if not keys:
                break
            s.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000,
                              "AUTH", PASSWORD, "KEYS", *keys)
            time.sleep(0.05)
        for master in cluster.masters():
            with _admin(master.url) as m:
                m.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    return dst.address


async def test_a_slot_migrating_while_routing_answers_nobody_or_the_truth(
    own_cluster: RedisCluster,
) -> None:
    cluster = own_cluster
    index = _index(cluster, "migrate", lookup_budget_s=1.0, write_timeout_s=1.0,
                   backoff_s=0.05, max_backoff_s=0.1)
    tenant = "moving-tenant"
    truth = {"r1": 8, "r2": 3}
    slot = redis.cluster.key_slot(tenant_tag(tenant).encode())
    try:
        await index.publish("r1", H[:8], tenant=tenant)
        await index.publish("r2", H[:3], tenant=tenant)
        assert await index.lookup_runs(H[:8], tenant=tenant) == truth
        stop = threading.Event()
        moved = asyncio.get_running_loop().run_in_executor(
            None, _migrate_slot, cluster, slot, stop)
        answers = {"truth": 0, "nobody": 0}
        try:
            while not moved.done():
                answer = await index.lookup_runs(H[:8], tenant=tenant)
                _truth_or_nobody(answer, truth)
                answers["truth" if answer else "nobody"] += 1
                await asyncio.sleep(0.005)
        finally:
            stop.set()
        new_owner = await moved
        assert cluster.master_of_slot(slot).address == new_owner
        deadline = time.monotonic() + 10
        while (await index.lookup_runs(H[:8], tenant=tenant) != truth
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        assert await index.lookup_runs(H[:8], tenant=tenant) == truth
        assert sum(answers.values()) > 0
    finally:
        await index.close()


async def test_the_publisher_sends_each_tenants_blocks_under_its_tenant(
    cluster: RedisCluster,
) -> None:
    index = _index(cluster, "publisher")
    publisher = HintPublisher(index, "r1")
    try:
        publisher.offer_stored(H[:3], tenant="acme")
        publisher.offer_stored(H[3:6], tenant="globex")
        publisher.offer_removed(H[2:3], tenant="acme")
        await publisher.flush()
        assert await index.lookup_runs(H[:3], tenant="acme") == {"r1": 2}
        assert await index.lookup_runs(H[3:6], tenant="globex") == {"r1": 3}
        assert await index.lookup_runs(H[3:6], tenant="acme") == {}
    finally:
        await index.close()


async def test_a_replica_configured_with_seed_urls_uses_the_cluster(cluster: RedisCluster) -> None:
    from kvfleet_runtime.fleet.fleet_tier import FleetSettings, hint_index_for, hint_index_kind

    settings = FleetSettings.from_env(
        {"KVFLEET_REDIS_CLUSTER_URLS": ",".join(cluster.seed_urls[:3]),
         "KVFLEET_REDIS_URL": "redis://127.0.0.1:1/0", "KVFLEET_FLEET_NAME": "r0"}, port=8000)
    assert settings is not None and len(settings.redis_cluster_urls) == 3
    index = hint_index_for(settings)
    try:
        assert hint_index_kind(index) == "redis-cluster"
        index.lookup_budget_s = 10.0  # type: ignore[attr-defined]
        await index.publish("r0", H[:2], tenant="acme")
        assert await index.lookup_runs(H[:2], tenant="acme") == {"r0": 2}
    finally:
        await index.close()
