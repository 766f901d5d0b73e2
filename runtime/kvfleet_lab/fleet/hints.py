"""`kvfleet bench hints`: the hint index under a fleet's publish and lookup streams, on one Redis
and on 3- and 6-master Redis Clusters started on loopback; and the two cluster layouts compared.

The workload is the fleet simulator's (`kvfleet_lab.simulate.Workload` and `Fleet` defaults):
83 requests/s over 44 replicas, prompts of 1,500 + 100 tokens (100 blocks), 2,000 tenants. Per
simulated replica and second: `rps_per_replica` requests, each publishing `publish_fraction` of
its 100 blocks through a real `HintPublisher` (50 ms / 512-hash batches; 1.0 is a cold fleet, the
upper bound: in steady state only the user's turn is new) and making `lookups_per_request`
100-block `lookup_runs` calls (the router's, and the replica's own before a peer fetch).

Each level N runs for `seconds`: achieved block writes/s and lookups/s against offered, lookup
p50/p99, publish lag (offer -> its batch written; p50/p99), and the Redis servers' own CPU time per
block write and per lookup (INFO cpu, summed over the masters). The load generator is one Python
process on the same cores, so on a small box it saturates before Redis does: the per-op server
CPU is what carries to another machine (one core per shard / CPU per op = a shard's ceiling).

Keys (`compare_keys`, `--keys`, issue 44): the shipped names before and after keying, side by
side on one Redis and a 3-master cluster: block keys named by the raw chain hash under Redis'
default user, against keyed digests (`hint_index.keyed_digest` under `auth.hint_key`) with the
replica's ACL user publishing and the router's looking up (`hint_index.ACL_RULES`). Per
variant: lookup p50/p99, the caller's CPU per lookup and per 100-block publish, the servers' CPU
per lookup, interleaved in batches; and the digest alone (ns per block hash).

Layouts (`compare_layouts`): the same 100-block chains on a 3-master cluster, looked up with the
shipped layout (tenant hash tag, one EVALSHA on one master) and with block keys spread over all
slots (a pipelined ZRANGEBYSCORE per block, one round trip per master in parallel, runs computed
here).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_lab.fleet.bench import _pct
from kvfleet_lab.fleet.redis_servers import RedisCluster, RedisNode, cluster_ports
from kvfleet_lab.processes import free_port
from kvfleet_lab.simulate import Fleet, Workload
from kvfleet_runtime.auth import hint_key
from kvfleet_runtime.fleet.hint_index import (
    RedisClusterHintIndex,
    RedisHintIndex,
    keyed_namer,
    leading_runs,
)
from kvfleet_runtime.fleet.publisher import HintPublisher
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = [
    "HintsBenchReport",
    "KeysResult",
    "LayoutResult",
    "LevelResult",
    "bench_hints",
    "compare_keys",
    "compare_layouts",
]

log = logging.getLogger(__name__)

_WORKLOAD = Workload()
_FLEET = Fleet()
RPS_PER_REPLICA = _WORKLOAD.rps / _FLEET.num_replicas
BLOCKS_PER_REQUEST = (_WORKLOAD.prefix_tokens + _WORKLOAD.suffix_tokens) // BLOCK_SIZE
TENANTS_PER_REPLICA = max(1, _WORKLOAD.num_tenants // _FLEET.num_replicas)


@dataclass(slots=True)
class LevelResult:
    target: str
    num_replicas: int
    offered_writes_per_s: float
    achieved_writes_per_s: float
    offered_lookups_per_s: float
    achieved_lookups_per_s: float
    lookup_p50_s: float
    lookup_p99_s: float
    publish_lag_p50_s: float
    publish_lag_p99_s: float
    server_cpu_s: float
    """Redis CPU (user + sys, all masters) over the level."""
    server_cpu_per_write_us: float
    server_cpu_per_lookup_us: float
    num_dropped: int
    num_errors: int


@dataclass(slots=True)
class LayoutResult:
    layout: str
    lookup_p50_s: float
    lookup_p99_s: float
    server_cpu_per_lookup_us: float
    num_lookups: int


@dataclass(slots=True)
class KeysResult:
    target: str
    variant: str
    lookup_p50_s: float
    lookup_p99_s: float
    client_cpu_per_lookup_us: float
    client_cpu_per_publish_us: float
    """One 100-block publish (the caller's side: names, script call)."""
    server_cpu_per_lookup_us: float
    num_lookups: int
    digest_ns_per_block: float = 0.0
    """The keyed digest alone, CPU per block hash (0 for the unkeyed variant)."""


@dataclass(slots=True)
class HintsBenchReport:
    seconds: float
    rps_per_replica: float
    blocks_per_request: int
    publish_fraction: float
    lookups_per_request: float
    levels: list[LevelResult] = field(default_factory=list)
    layouts: list[LayoutResult] = field(default_factory=list)
    keys: list[KeysResult] = field(default_factory=list)
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class _SpreadLayoutIndex(RedisClusterHintIndex):
    """The layout not shipped: block keys without a tag (spread over all slots), a lookup is a
    cluster pipeline (one round trip per master, in parallel) and the runs are computed here."""

    def _block_key(self, h: bytes, tenant: str | None = None) -> str:
        return f"{self.namespace}:b:{h.hex()}"

    async def publish(self, host: str, hashes: Sequence[bytes], *,
                      tenant: str | None = None) -> None:
        # Keys in many slots: no script; a cluster pipeline (one round trip per master).
        expiry = self.clock() + self.ttl_s
        ttl = max(1, int(self.ttl_s))

        def build(pipe: Any) -> None:
            for h in hashes:
                key = self._block_key(h)
                pipe.zadd(key, {host: expiry})
                pipe.expire(key, ttl)

        await self._call(lambda: self._pipeline(build), self.write_timeout_s)

    async def lookup_runs(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> dict[str, int]:
        return leading_runs(await self.lookup(hashes, tenant=tenant))


def _masters_cpu_s(nodes: Sequence[RedisNode]) -> float:
    total = 0.0
    for node in nodes:
        info = node.command("INFO cpu")
        for line in info.splitlines():
            name, _, value = line.partition(":")
            if name in ("used_cpu_sys", "used_cpu_user"):
                total += float(value)
    return total


class _TimedIndex:
    """Wraps an index: when a publish completes, the lag of each of its hashes since offered."""

    def __init__(self, index: RedisHintIndex) -> None:
        self.index = index
        self.stats = index.stats
        self.offered_at: dict[bytes, float] = {}
        self.lags_s: list[float] = []

    async def publish(self, host: str, hashes: Sequence[bytes], *,
                      tenant: str | None = None) -> None:
        await self.index.publish(host, hashes, tenant=tenant)
        now = time.perf_counter()
        for h in hashes:
            at = self.offered_at.pop(h, None)
            if at is not None:
                self.lags_s.append(now - at)

    async def withdraw(self, host: str, hashes: Sequence[bytes], *,
                       tenant: str | None = None) -> None:
        await self.index.withdraw(host, hashes, tenant=tenant)


async def _run_level(index: RedisHintIndex, masters: Sequence[RedisNode], target: str,
                     num_replicas: int, seconds: float, publish_fraction: float,
                     lookups_per_request: float, seed: int) -> LevelResult:
    rng = random.Random(seed)
    timed = _TimedIndex(index)
    publishers = [HintPublisher(timed, f"r{i}") for i in range(num_replicas)]  # type: ignore[arg-type]
    for p in publishers:
        p.start()
    lookup_s: list[float] = []
    request_rate = RPS_PER_REPLICA * num_replicas
    tenants = [f"tenant-{i}" for i in range(TENANTS_PER_REPLICA * num_replicas)]
    # The chains looked up are ones published earlier in the level (a hit or a partial one).
    published: list[tuple[str, list[bytes]]] = []
    cpu_before = _masters_cpu_s(masters)
    errors_before = index.stats.num_errors
    tasks: set[asyncio.Task[None]] = set()

    async def lookup(tenant: str, chain: list[bytes]) -> None:
        start = time.perf_counter()
        await index.lookup_runs(chain, tenant=tenant)
        lookup_s.append(time.perf_counter() - start)

    start = time.perf_counter()
    next_at = start
    while next_at < start + seconds:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tenant = rng.choice(tenants)
        chain = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(BLOCKS_PER_REQUEST)]
        num_new = round(publish_fraction * BLOCKS_PER_REQUEST)
        now = time.perf_counter()
        for h in chain[:num_new]:
            timed.offered_at[h] = now
        rng.choice(publishers).offer_stored(chain[:num_new], tenant=tenant)
        published.append((tenant, chain))
        num_lookups = int(lookups_per_request) + (rng.random() < lookups_per_request % 1)
        for _ in range(num_lookups):
            t, c = rng.choice(published[-200:])
            task = asyncio.create_task(lookup(t, c))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(request_rate)
    for p in publishers:
        await p.close()
    if tasks:
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    cpu_s = _masters_cpu_s(masters) - cpu_before
    written = len(timed.lags_s)
    offered_lookups = request_rate * lookups_per_request
    return LevelResult(
        target=target,
        num_replicas=num_replicas,
        offered_writes_per_s=request_rate * publish_fraction * BLOCKS_PER_REQUEST,
        achieved_writes_per_s=written / elapsed,
        offered_lookups_per_s=offered_lookups,
        achieved_lookups_per_s=len(lookup_s) / elapsed,
        lookup_p50_s=_pct(lookup_s, 0.5),
        lookup_p99_s=_pct(lookup_s, 0.99),
        publish_lag_p50_s=_pct(timed.lags_s, 0.5),
        publish_lag_p99_s=_pct(timed.lags_s, 0.99),
        server_cpu_s=cpu_s,
        server_cpu_per_write_us=cpu_s * 1e6 / max(1, written) if written else 0.0,
        server_cpu_per_lookup_us=0.0,
        num_dropped=sum(p.stats.num_dropped for p in publishers),
        num_errors=index.stats.num_errors - errors_before,
    )


async def _lookup_cpu_us(index: RedisHintIndex, masters: Sequence[RedisNode],
                         chains: Sequence[tuple[str, list[bytes]]], n: int) -> float:
    """Server CPU per lookup: `n` sequential lookups alone, nothing else running."""
    before = _masters_cpu_s(masters)
    for i in range(n):
        tenant, chain = chains[i % len(chains)]
        await index.lookup_runs(chain, tenant=tenant)
    return (_masters_cpu_s(masters) - before) * 1e6 / n


def _index_for(target: str, server: RedisNode | RedisCluster, **kwargs: Any) -> RedisHintIndex:
    # One index plays every simulated replica: no single process's connection cap applies.
    generous = {"lookup_budget_s": 1.0, "write_timeout_s": 5.0, "max_connections": 1 << 16,
                **kwargs}
    if isinstance(server, RedisCluster):
        return RedisClusterHintIndex.from_urls(server.seed_urls[:3], **generous)
    return RedisHintIndex.from_url(server.url, **generous)


def bench_hints(
    *,
    targets: Sequence[str] = ("redis", "cluster-3", "cluster-6"),
    replica_counts: Sequence[int] = (10, 44, 100, 200, 400),
    seconds: float = 4.0,
    publish_fraction: float = 1.0,
    lookups_per_request: float = 2.0,
    layouts: bool = True,
    keys: bool = False,
) -> HintsBenchReport:
    report = HintsBenchReport(seconds, RPS_PER_REPLICA, BLOCKS_PER_REQUEST, publish_fraction,
                              lookups_per_request)
    with tempfile.TemporaryDirectory() as tmp:
        if keys:
            for target in ("redis", "cluster-3"):
                with ExitStack() as stack:
                    server, masters = _start(target, Path(tmp) / f"keys-{target}", stack,
                                             role_passwords=_ROLE_PASSWORDS)
                    report.keys += asyncio.run(compare_keys(target, server, masters))
            targets, layouts = (), False
        for target in targets:
            with ExitStack() as stack:
                server, masters = _start(target, Path(tmp) / target, stack)
                for n in replica_counts:
                    index = _index_for(target, server)
                    level = asyncio.run(_level_with_cpu(index, masters, target, n, seconds,
                                                        publish_fraction, lookups_per_request))
                    report.levels.append(level)
                    log.info("%s N=%d: %s", target, n, level)
                    # Past saturation: the achieved rate falls well short of the offered.
                    if level.achieved_writes_per_s < 0.7 * level.offered_writes_per_s:
                        break
        if layouts:
            with ExitStack() as stack:
                server, masters = _start("cluster-3", Path(tmp) / "layouts", stack)
                report.layouts = asyncio.run(compare_layouts(server, masters))
                log.info("layouts: %s", report.layouts)
    report.load_average = os.getloadavg()
    return report


async def _level_with_cpu(index: RedisHintIndex, masters: Sequence[RedisNode], target: str,
                          n: int, seconds: float, publish_fraction: float,
                          lookups_per_request: float) -> LevelResult:
    try:
        level = await _run_level(index, masters, target, n, seconds, publish_fraction,
                                 lookups_per_request, seed=n)
        rng = random.Random(0)
        chains = [(f"tenant-{i}", [rng.getrandbits(128).to_bytes(16, "big")
                                   for _ in range(BLOCKS_PER_REQUEST)]) for i in range(20)]
        for tenant, chain in chains:
            await index.publish("r0", chain, tenant=tenant)
        level.server_cpu_per_lookup_us = await _lookup_cpu_us(index, masters, chains, 300)
        return level
    finally:
        await index.close()


def _start(target: str, workdir: Path, stack: ExitStack,
           role_passwords: dict[str, str] | None = None
           ) -> tuple[RedisNode | RedisCluster, list[RedisNode]]:
    if target == "redis":
        node = RedisNode(free_port(), workdir, role_passwords=dict(role_passwords or {}))
        node.start()
        stack.callback(node.kill)
        return node, [node]
    if not target.startswith("cluster-"):
        raise ValueError(f"unknown target {target!r}: redis, cluster-3 or cluster-6")
    num_masters = int(target.removeprefix("cluster-"))
    if num_masters < 3:
        raise ValueError(f"a Redis Cluster needs at least 3 masters, got {target!r}")
    # No replicas: on a shared box their replication CPU would be charged to the masters' load.
    cluster = RedisCluster(cluster_ports(num_masters), workdir, replicas_per_master=0,
                           role_passwords=dict(role_passwords or {}))
    stack.callback(cluster.stop)
    cluster.start()
    return cluster, cluster.masters()


async def compare_layouts(cluster: RedisNode | RedisCluster, masters: Sequence[RedisNode],
                          *, num_chains: int = 50, num_lookups: int = 300) -> list[LayoutResult]:
    assert isinstance(cluster, RedisCluster)
    rng = random.Random(3)
    chains = [(f"tenant-{i}", [rng.getrandbits(128).to_bytes(16, "big")
                               for _ in range(BLOCKS_PER_REQUEST)]) for i in range(num_chains)]
    results = []
    indexes: list[tuple[str, RedisHintIndex]] = [
        ("tenant-tagged, one EVALSHA", _index_for("cluster-3", cluster, namespace="tagged")),
        ("spread, pipeline per master", _SpreadLayoutIndex.from_urls(
            cluster.seed_urls[:3], lookup_budget_s=1.0, write_timeout_s=5.0,
            namespace="spread")),
    ]
    for _name, index in indexes:
        for tenant, chain in chains:
            for host in ("r1", "r2"):
                await index.publish(host, chain, tenant=tenant)
        await index.lookup_runs(chains[0][1], tenant=chains[0][0])  # load the script, warm
    # Interleaved in batches, so both layouts see the same moments of a noisy machine; the
    # servers' CPU is read per batch (its accounting is too coarse for one lookup).
    times: dict[str, list[float]] = {name: [] for name, _ in indexes}
    cpu: dict[str, float] = {name: 0.0 for name, _ in indexes}
    batch = 30
    for b in range(num_lookups // batch):
        for name, index in indexes:
            before = _masters_cpu_s(masters)
            for i in range(b * batch, (b + 1) * batch):
                tenant, chain = chains[i % num_chains]
                start = time.perf_counter()
                runs = await index.lookup_runs(chain, tenant=tenant)
                times[name].append(time.perf_counter() - start)
                assert runs == {"r1": BLOCKS_PER_REQUEST, "r2": BLOCKS_PER_REQUEST}, (name, runs)
            cpu[name] += _masters_cpu_s(masters) - before
    for name, index in indexes:
        results.append(LayoutResult(name, _pct(times[name], 0.5), _pct(times[name], 0.99),
                                    cpu[name] * 1e6 / len(times[name]), len(times[name])))
        await index.close()
    return results


_ROLE_PASSWORDS = {"replica": "bench-replica", "router": "bench-router"}
_BENCH_HINT_KEY = hint_key(b"bench-router-secret") or b""


def _role_index(server: RedisNode | RedisCluster, role: str | None, **kwargs: Any
                ) -> RedisHintIndex:
    generous: dict[str, Any] = {"lookup_budget_s": 1.0, "write_timeout_s": 5.0, **kwargs}
    if isinstance(server, RedisCluster):
        urls = server.seed_urls_for(role)[:3] if role else server.seed_urls[:3]
        return RedisClusterHintIndex.from_urls(urls, **generous)
    return RedisHintIndex.from_url(server.url_for(role) if role else server.url, **generous)


async def compare_keys(target: str, server: RedisNode | RedisCluster,
                       masters: Sequence[RedisNode], *, num_chains: int = 50,
                       num_lookups: int = 600) -> list[KeysResult]:
    """Raw-hash names under the default user vs keyed names under the role users, interleaved."""
    rng = random.Random(4)
    chains = [(f"tenant-{i}", [rng.getrandbits(128).to_bytes(16, "big")
                               for _ in range(BLOCKS_PER_REQUEST)]) for i in range(num_chains)]
    variants = {
        "raw hash names, default user": (
            _role_index(server, None, namespace="raw"), _role_index(server, None, namespace="raw")),
        "keyed names, ACL role users": (
            _role_index(server, "replica", namespace="kvfleet", hint_key=_BENCH_HINT_KEY),
            _role_index(server, "router", namespace="kvfleet", hint_key=_BENCH_HINT_KEY)),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    lookup_cpu = dict.fromkeys(variants, 0.0)
    publish_cpu = dict.fromkeys(variants, 0.0)
    server_cpu = dict.fromkeys(variants, 0.0)
    for publisher, looker in variants.values():
        for tenant, chain in chains:
            await publisher.publish("r1", chain, tenant=tenant)
        await looker.lookup_runs(chains[0][1], tenant=chains[0][0])  # load the script, warm
    batch = 30
    for b in range(num_lookups // batch):
        for name, (publisher, looker) in variants.items():
            before_server = _masters_cpu_s(masters)
            before = time.process_time()
            for i in range(b * batch, (b + 1) * batch):
                tenant, chain = chains[i % num_chains]
                start = time.perf_counter()
                runs = await looker.lookup_runs(chain, tenant=tenant)
                times[name].append(time.perf_counter() - start)
                assert runs == {"r1": BLOCKS_PER_REQUEST}, (name, runs)
            lookup_cpu[name] += time.process_time() - before
            server_cpu[name] += _masters_cpu_s(masters) - before_server
            before = time.process_time()
            for i in range(b * batch // 10, (b + 1) * batch // 10):  # re-publishes: 3 a batch
                tenant, chain = chains[i % num_chains]
                await publisher.publish("r1", chain, tenant=tenant)
            publish_cpu[name] += time.process_time() - before
    hashes = [h for _, chain in chains for h in chain]
    keyed_name = keyed_namer(_BENCH_HINT_KEY)
    start = time.process_time()
    for h in hashes:
        keyed_name(h)
    digest_ns = (time.process_time() - start) * 1e9 / len(hashes)
    results = []
    num_publishes = num_lookups // 10
    for name, (publisher, looker) in variants.items():
        n = len(times[name])
        results.append(KeysResult(
            target, name, _pct(times[name], 0.5), _pct(times[name], 0.99),
            lookup_cpu[name] * 1e6 / n, publish_cpu[name] * 1e6 / num_publishes,
            server_cpu[name] * 1e6 / n, n,
            digest_ns if publisher.hint_key else 0.0))
        await publisher.close()
        await looker.close()
    return results
