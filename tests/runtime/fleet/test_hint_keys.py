"""Hint keys that reveal nothing, and publishes only from fleet members (issue 44 deliverable 2),
on a real redis-server and a real Redis Cluster on loopback, each with the hint index's ACL users
(`ACL_RULES`, as the chart's Redis has them).

Reading Redis tells nothing: every block is named by its keyed digest under the fleet's hint key
(derived from the router secret), a cluster key's tenant tag too, so neither a guessed prompt's
chain hash nor a guessed tenant name can be found. Writing needs the replica's ACL user: the
router's user can look up and nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from kvfleet_lab.fleet.redis_servers import (
    RedisCluster,
    RedisNode,
    cluster_ports,
    redis_tools_missing,
    running_cluster,
)
from kvfleet_runtime.auth import hint_key
from kvfleet_runtime.cache import CacheKey, block_hashes
from kvfleet_runtime.fleet import RedisClusterHintIndex, RedisHintIndex
from kvfleet_runtime.fleet.hint_index import ACL_USERS, keyed_digest, tenant_tag
from tests.support import free_port

KEY = hint_key(b"router-secret-of-the-fleet")
assert KEY is not None
ROLES = {"replica": "replica-pw", "router": "router-pw"}
ADMIN = "admin-pw"
TENANT = "acme"
CHAIN = block_hashes(CacheKey(TENANT, "m", "sha256:" + "ab" * 32, "float16", "r", "sdpa"),
                     list(range(16 * 6)))
"""A real prompt's chain: what a reader of Redis would hash a guessed prompt into."""
GENEROUS = {"lookup_budget_s": 10.0, "write_timeout_s": 10.0}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisNode]:
    missing = redis_tools_missing()
    if missing:
        pytest.skip(missing)
    node = RedisNode(free_port(), tmp_path, password=ADMIN, role_passwords=dict(ROLES))
    node.start()
    try:
        yield node
    finally:
        node.kill()


@pytest.fixture
async def indexes(server: RedisNode) -> AsyncIterator[dict[str, RedisHintIndex]]:
    made = {role: RedisHintIndex.from_url(server.url_for(role), hint_key=KEY, **GENEROUS)
            for role in ROLES}
    yield made
    for index in made.values():
        await index.close()


def _every_key(url: str) -> list[bytes]:
    with redis.Redis.from_url(url, socket_timeout=5) as admin:
        return sorted(admin.keys("*"))


async def test_keyed_names_reveal_neither_the_chain_nor_the_tenant(
    server: RedisNode, indexes: dict[str, RedisHintIndex]
) -> None:
    replica, router = indexes["replica"], indexes["router"]
    await replica.publish("r1", CHAIN, tenant=TENANT)
    await replica.register_host("r1", "http://10.0.0.1:8000")
    assert await router.lookup_runs(CHAIN, tenant=TENANT) == {"r1": len(CHAIN)}
    assert await router.lookup(CHAIN[:2], tenant=TENANT) == [frozenset({"r1"})] * 2
    keys = _every_key(server.url)
    blocks = [k for k in keys if k.startswith(b"kvfleet:k:")]
    assert len(blocks) == len(CHAIN)
    dump = b" ".join(keys)
    for h in CHAIN:  # what a reader would look for, having hashed a guessed prompt
        assert h.hex().encode() not in dump
    assert TENANT.encode() not in dump
    assert {k[len(b"kvfleet:k:"):] for k in blocks} == {
        keyed_digest(KEY, h).hex().encode() for h in CHAIN}
    # a process without the fleet's key (another fleet, an old version) finds nothing
    other = RedisHintIndex.from_url(server.url_for("router"), hint_key=hint_key(b"other"),
                                    **GENEROUS)
    unkeyed = RedisHintIndex.from_url(server.url_for("router"), **GENEROUS)
    try:
        assert await other.lookup_runs(CHAIN, tenant=TENANT) == {}
        assert await unkeyed.lookup_runs(CHAIN, tenant=TENANT) == {}
    finally:
        await other.close()
        await unkeyed.close()


async def test_only_the_replicas_user_can_write(
    server: RedisNode, indexes: dict[str, RedisHintIndex]
) -> None:
    replica, router = indexes["replica"], indexes["router"]
    await replica.publish("r1", CHAIN[:3], tenant=TENANT)
    before = _every_key(server.url)
    errors = router.stats.num_errors
    await router.publish("evil", CHAIN, tenant=TENANT)  # refused by the ACL: dropped
    router._down_until.clear()  # (the failure backs the index off; the next call is a new try)
    await router.withdraw("r1", CHAIN[:3], tenant=TENANT)
    router._down_until.clear()
    await router.register_host("r1", "http://attacker:1")
    router._down_until.clear()
    assert router.stats.num_errors == errors + 3
    assert _every_key(server.url) == before
    assert await router.lookup_runs(CHAIN, tenant=TENANT) == {"r1": 3}
    assert await replica.host_url("r1") is None  # never registered: not the attacker's either
    # the script path too: EVAL of a write, under the router's user
    with (redis.Redis.from_url(server.url_for("router"), socket_timeout=5) as client,
          pytest.raises(redis.exceptions.ResponseError, match="can't run this command")):
        client.eval("return redis.call('ZADD', KEYS[1], 1, 'evil')", 1, before[0].decode())
    # and the default user's password is not the roles'
    with (redis.Redis.from_url(f"redis://:{ROLES['replica']}@127.0.0.1:{server.port}/0",
                               socket_timeout=5) as client,
          pytest.raises(redis.exceptions.AuthenticationError)):
        client.ping()


@pytest.fixture(scope="module")
def acl_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    missing = redis_tools_missing()
    if missing:
        pytest.skip(missing)
    with running_cluster(cluster_ports(6), tmp_path_factory.mktemp("acl-cluster"),
                         password=ADMIN, role_passwords=dict(ROLES)) as cluster:
        yield cluster


async def test_a_redis_cluster_with_acl_users_and_keyed_names(acl_cluster: RedisCluster) -> None:
    replica = RedisClusterHintIndex.from_urls(acl_cluster.seed_urls_for("replica")[:2],
                                              hint_key=KEY, **GENEROUS)
    router = RedisClusterHintIndex.from_urls(acl_cluster.seed_urls_for("router")[:2],
                                             hint_key=KEY, **GENEROUS)
    try:
        await replica.publish("r1", CHAIN, tenant=TENANT)
        await replica.publish("r2", CHAIN[:2], tenant="globex")
        assert await router.lookup_runs(CHAIN, tenant=TENANT) == {"r1": len(CHAIN)}
        assert await router.lookup_runs(CHAIN, tenant="globex") == {"r2": 2}
        await router.publish("evil", CHAIN, tenant=TENANT)
        assert router.stats.num_errors == 1
        router._down_until.clear()
        assert await router.lookup_runs(CHAIN, tenant=TENANT) == {"r1": len(CHAIN)}
        tag = tenant_tag(TENANT, KEY)
        assert tag != tenant_tag(TENANT)  # the unkeyed tag would confirm a guessed name
        slot = redis.cluster.key_slot(tag.encode())
        master = acl_cluster.master_of_slot(slot)
        keys = _every_key(master.url)
        mine = [k for k in keys if tag.encode() in k]
        assert len(mine) == len(CHAIN) and all(k.startswith(b"kvfleet:k:{t") for k in mine)
        assert not any(h.hex().encode() in k for k in keys for h in CHAIN)
        assert ACL_USERS["router"] in acl_cluster.seed_urls_for("router")[0]
    finally:
        await replica.close()
        await router.close()
