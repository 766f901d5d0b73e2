"""The global hint index: block hash -> the hosts that (probably) hold it.

A hint, never a source of truth. An entry can be stale in both directions: a listed host may have
evicted the block (the fetch finds less or nothing and the request recomputes) and an unlisted
host may hold it (a missed opportunity). Either costs performance, never correctness. So every
method here swallows its failures: a lookup that cannot answer within its budget answers "nobody",
a publish that fails is dropped. Nothing raises to the request path.

Three implementations with one contract (`HintIndex`):

- `EmbeddedHintIndex`: a dict in this process; it only sees what this process published. The
  fallback when neither a Redis URL nor the fleet's replica list is configured.
- `PeerProbeHintIndex` (`fleet.probe`): no Redis, but the replica list is known (the fleet
  config): a lookup asks every peer directly how much of the chain it holds. So several replica
  processes on one machine find each other's blocks with nothing to install.
- `RedisHintIndex` (redis.asyncio), shared by the replicas and routers of a fleet:

      {ns}:b:{hash hex}  sorted set, member = host name, score = expiry (unix s); key EXPIREs
      {ns}:h:{host}      string, the host's peer URL; EX ttl

  Per-member expiry in a sorted set gives each host its own TTL on one key (Redis 6+, no
  hash-field TTLs needed). The request-path query, `lookup_runs`, is one EVALSHA round trip: a
  Lua script walks the blocks in chain order, intersects the live hosts and stops at the first
  block nobody holds, returning only {host: run length}, so a 2,000-token prompt costs one
  small reply instead of 125 (a pipelined reply costs ~0.2 ms per block in pure-Python
  redis-py). It runs under `lookup_budget_s`. After a failure the index stops asking Redis for a
  backoff period (doubling to `max_backoff_s`), so an outage costs each request nothing, not a
  timeout. Host names and clocks: expiry is the publisher's wall clock; skew between hosts only
  shifts staleness, which is already allowed.
- `RedisClusterHintIndex` (redis.asyncio.cluster), the same on a Redis Cluster. A Lua script may
  only touch keys of one slot, so a block key carries its tenant's hash tag:

      {ns}:b:{t<tenant digest>}:<hash hex>   (the tag: 16 hex digits of blake2b(tenant))

  Every block of one tenant's chains lives in one slot, and a lookup stays one EVALSHA to one
  master. The alternative, block keys spread over all slots and one pipelined round trip per
  shard in parallel with the runs computed here, was measured on the same workload and lost
  (`kvfleet bench hints --layouts`; docs/fleet.md). The price: one tenant's whole hint traffic
  lands on one shard, so a hot tenant loads one master, never all of them. Backoff is per
  shard (a dead master turns off the lookups of its own slots only), and after an error the
  slot map is refreshed in the background, outside any request's budget, so lookups find the
  promoted replica as soon as the cluster has one.

After any error either index reconnects and loads its scripts in the background (under the write
timeout), outside any request's budget: a 2 ms budget cannot hold a connect, AUTH and a script
load, and a call cut short drops its half-made connection.

Keys that reveal nothing (issue 44). A block hash is the chain hash of a tenant's prompt, so a
key named by it let anyone who can read Redis test whether a tenant sent a guessed prompt (hash
the guess, look for the key). With a `hint_key` (every process of a fleet derives the same one
from the router secret, `auth.hint_key`; Redis never sees it) each block is named by its keyed
digest instead, and so is a cluster key's tenant tag:

      {ns}:k:{keyed digest hex}                 (`keyed_digest`: BLAKE2b-128 keyed)
      {ns}:k:{t<keyed tenant digest>}:{keyed digest hex}     (Redis Cluster)

A reader of Redis sees random names: without the key it can neither confirm a guess nor tell
which tenant a key belongs to, nor compute the key of a prompt it wants to steer (a writer can
only copy or drop entries it cannot read, which misroutes at random: a cost, never a leak). Who
may write at all is Redis' ACL (`ACL_RULES`): replicas publish, routers only read. Without a key
(no router secret: a laptop) the old `{ns}:b:` names are used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvfleet_runtime.pools import REDIS_MAX_CONNECTIONS

__all__ = [
    "ACL_RULES",
    "ACL_USERS",
    "DEFAULT_TTL_S",
    "EmbeddedHintIndex",
    "HintIndex",
    "HintIndexStats",
    "RedisClusterHintIndex",
    "RedisHintIndex",
    "best_peer",
    "keyed_digest",
    "keyed_namer",
    "leading_runs",
    "split_seed_urls",
    "tenant_tag",
]

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 900.0
"""How long a published hint lives unless re-published (a held block is re-offered on use)."""

DIGEST_BYTES = 16
"""Width of a block's keyed digest (as wide as a block hash: 128 bits)."""

ACL_USERS = {"replica": "kvfleet-replica", "router": "kvfleet-router"}
"""The Redis user of each role (its URL: redis://kvfleet-router:<password>@host:port/0)."""

ACL_RULES = {
    "replica": "resetkeys ~kvfleet:* resetchannels -@all +@connection +evalsha +eval "
               "+script|load +zadd +zrem +expire +zrangebyscore +set +get +cluster|slots "
               "+cluster|shards +readonly",
    "router": "resetkeys ~kvfleet:* resetchannels -@all +@connection +evalsha +eval "
              "+script|load +zrangebyscore +get +cluster|slots +cluster|shards +readonly",
}
"""Redis ACL rules (after `user <name> on ><password>`) of the two roles that use the hint index:
replicas (and vLLM connectors) publish, withdraw and register; routers run only reading
commands. Commands a script calls are checked against the caller's ACL, so the router's user
can run the lookup script and any write (the publish script's first ZADD, an EVAL of its own)
is refused with NOPERM. (Not a read-only key pattern, `%R~`: Redis counts a script's declared
keys as written unless the script carries 7.0's `flags=no-writes`, which Redis 6 cannot
parse.) The chart's bundled Redis runs with these users; an external Redis or Redis Cluster
should be given the same (docs/security.md)."""


def keyed_digest(key: bytes, h: bytes) -> bytes:
    """A block hash's name in the index: keyed BLAKE2b-128 (BLAKE2's keyed mode is a MAC by
    design: no HMAC construction needed, and it costs a third of HMAC-SHA256 here)."""
    return hashlib.blake2b(h, key=key, digest_size=DIGEST_BYTES).digest()


def keyed_namer(key: bytes) -> Callable[[bytes], bytes]:
    """`keyed_digest` under `key` as one function, the key's block compressed once: each name
    copies that state (0.7x the time of keying anew; `kvfleet bench hints --keys`)."""
    keyed = hashlib.blake2b(key=key, digest_size=DIGEST_BYTES)

    def name(h: bytes) -> bytes:
        state = keyed.copy()
        state.update(h)
        return state.digest()

    return name


@dataclass(slots=True)
class HintIndexStats:
    num_lookups: int = 0
    num_published: int = 0
    num_withdrawn: int = 0
    num_errors: int = 0
    """Failed or timed-out calls (each answered "nobody" or dropped)."""
    num_skipped: int = 0
    """Calls not attempted because the index is backing off after an error."""
    num_busy: int = 0
    """Lookups not attempted because every connection was in use (`max_connections`)."""


class HintIndex(Protocol):
    stats: HintIndexStats

    async def publish(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        """Announce that `host` holds `hashes` (blocks of `tenant`'s chains); best effort.
        `tenant` places the keys on Redis Cluster (one tenant, one slot); a lookup finds a
        block only under the tenant it was published for."""

    async def withdraw(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        """Announce that `host` dropped `hashes` (published for `tenant`); best effort."""

    async def lookup(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> list[frozenset[str]]:
        """Hosts listed for each hash (same length as `hashes`); all empty on any failure.
        `tenant`: whose chain `hashes` is (the peer-probe index needs it for the credential;
        Redis Cluster for the slot; the others ignore it)."""

    async def lookup_runs(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> dict[str, int]:
        """`leading_runs(lookup(hashes))`, in one round trip; {} on any failure."""

    async def register_host(self, host: str, url: str) -> None:
        """Publish where `host` serves its peer endpoint (re-register before the TTL ends)."""

    async def host_url(self, host: str) -> str | None:
        """The registered peer URL of `host`, or None (unknown, expired or index down)."""

    async def close(self) -> None: ...


def leading_runs(hosts_per_block: Sequence[frozenset[str]]) -> dict[str, int]:
    """For each host, how many blocks from the first one it is listed on without a gap.

    Chains make a run from block 0 the only useful unit: block i is worth nothing without
    blocks 0..i-1."""
    runs: dict[str, int] = {}
    alive: set[str] | None = None
    for i, hosts in enumerate(hosts_per_block):
        alive = set(hosts) if alive is None else alive & hosts
        if not alive:
            break
        for host in alive:
            runs[host] = i + 1
    return runs


def best_peer(runs: dict[str, int], *, exclude: str | None = None) -> tuple[str, int] | None:
    """The host with the longest run (ties: smallest name), never `exclude`; None if none."""
    candidates = sorted((-n, host) for host, n in runs.items() if host != exclude and n > 0)
    return (candidates[0][1], -candidates[0][0]) if candidates else None


class EmbeddedHintIndex:
    """In-process index with the same semantics as Redis (per-host expiry). Bounded: past
    `max_entries` hashes, expired entries are swept and, if still full, new hashes are dropped."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 1 << 20,
    ) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_entries = max_entries
        self.stats = HintIndexStats()
        self._blocks: dict[bytes, dict[str, float]] = {}
        self._hosts: dict[str, tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    async def publish(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        expiry = self.clock() + self.ttl_s
        if len(self._blocks) + len(hashes) > self.max_entries:
            self._sweep()
        for h in hashes:
            entry = self._blocks.get(h)
            if entry is None:
                if len(self._blocks) >= self.max_entries:
                    continue
                entry = self._blocks[h] = {}
            entry[host] = expiry
        self.stats.num_published += len(hashes)

    async def withdraw(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        for h in hashes:
            entry = self._blocks.get(h)
            if entry is not None:
                entry.pop(host, None)
                if not entry:
                    del self._blocks[h]
        self.stats.num_withdrawn += len(hashes)

    async def lookup(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> list[frozenset[str]]:
        self.stats.num_lookups += 1
        now = self.clock()
        return [
            frozenset(host for host, exp in self._blocks.get(h, {}).items() if exp > now)
            for h in hashes
        ]

    async def lookup_runs(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> dict[str, int]:
        return leading_runs(await self.lookup(hashes))

    async def register_host(self, host: str, url: str) -> None:
        self._hosts[host] = (url, self.clock() + self.ttl_s)

    async def host_url(self, host: str) -> str | None:
        entry = self._hosts.get(host)
        return entry[0] if entry is not None and entry[1] > self.clock() else None

    async def close(self) -> None:
        self._blocks.clear()

    def _sweep(self) -> None:
        now = self.clock()
        for h in list(self._blocks):
            entry = {host: exp for host, exp in self._blocks[h].items() if exp > now}
            if entry:
                self._blocks[h] = entry
            else:
                del self._blocks[h]


class RedisHintIndex:
    """The shared index in Redis. `client` is a `redis.asyncio.Redis`; use `from_url`.
    `max_connections` must be what the client's pool is capped at (`from_url` does both)."""

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "kvfleet",
        ttl_s: float = DEFAULT_TTL_S,
        lookup_budget_s: float = 0.002,
        write_timeout_s: float = 0.5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        max_connections: int = REDIS_MAX_CONNECTIONS,
        hint_key: bytes | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.hint_key = hint_key or None
        """Blocks are named by their keyed digest under it (`keyed_digest`); None: by hash."""
        self._keyed_name = keyed_namer(self.hint_key) if self.hint_key else None
        self._client = client
        self.max_connections = max_connections
        self._slots = asyncio.Semaphore(max_connections)
        self._calls: set[asyncio.Future[Any]] = set()
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.lookup_budget_s = lookup_budget_s
        self.write_timeout_s = write_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.monotonic = monotonic
        self.stats = HintIndexStats()
        # Per shard ("" for one Redis): until when it is not asked, and its next backoff.
        self._down_until: dict[str, float] = {}
        self._next_backoff_s: dict[str, float] = {}
        self._runs_script = client.register_script(_RUNS_LUA)
        self._publish_script = client.register_script(_PUBLISH_LUA)
        self._withdraw_script = client.register_script(_WITHDRAW_LUA)
        self._warming: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisHintIndex:
        from redis.asyncio import Redis

        connect_timeout_s = kwargs.pop("connect_timeout_s", 0.5)
        kwargs.setdefault("max_connections", REDIS_MAX_CONNECTIONS)
        client = Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=kwargs.get("write_timeout_s", 0.5),
            retry_on_timeout=False,
            health_check_interval=0,
            max_connections=kwargs["max_connections"],
        )
        return cls(client, **kwargs)

    @property
    def available(self) -> bool:
        """False while backing off after an error (on every shard, for a cluster)."""
        now = self.monotonic()
        return not self._down_until or any(now >= t for t in self._down_until.values())

    def _block_prefix(self, tenant: str | None = None) -> str:
        return f"{self.namespace}:{'k' if self.hint_key else 'b'}:"

    def _name(self, h: bytes) -> bytes:
        """What names block `h` in Redis: its keyed digest, or itself without a key."""
        return h if self._keyed_name is None else self._keyed_name(h)

    def _block_key(self, h: bytes, tenant: str | None = None) -> str:
        return self._block_prefix(tenant) + self._name(h).hex()

    def _host_key(self, host: str) -> str:
        return f"{self.namespace}:h:{host}"

    def _shard(self, key: str) -> str:
        """Which backoff `key`'s calls share: one Redis is one shard."""
        return ""

    def _after_error(self) -> None:
        """A call failed: reconnect and load the scripts in the background, under the write
        timeout. A request's budget (2 ms) cannot hold a connect, AUTH and a script load; cut
        short, the half-made connection is dropped and the next call starts over, so without
        this an index whose first calls time out would never warm up."""
        if self._warming is None or self._warming.done():
            self._warming = asyncio.get_running_loop().create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            await asyncio.wait_for(self._load_scripts(), self.write_timeout_s)
        except Exception as exc:
            log.debug("hint index: warm-up failed: %r", exc)

    async def _load_scripts(self) -> None:
        for script in (_RUNS_LUA, _PUBLISH_LUA, _WITHDRAW_LUA):
            await self._client.script_load(script)

    async def _pipeline(self, build: Callable[[Any], None]) -> list[Any]:
        async with self._client.pipeline(transaction=False) as pipe:
            build(pipe)
            result: list[Any] = await pipe.execute()
        return result

    async def _call(
        self, make: Callable[[], Awaitable[Any]], timeout_s: float, shard: str = "",
        *, wait: bool = True,
    ) -> Any:
        """`make()`'s result, or None when it failed, timed out or was not tried (backoff; or,
        unless `wait`, every connection busy). At most `max_connections` calls are in flight."""
        if self.monotonic() < self._down_until.get(shard, 0.0):
            self.stats.num_skipped += 1
            return None
        if not wait and self._slots.locked():
            self.stats.num_busy += 1  # saturated, not broken: no backoff
            return None
        try:
            if wait:
                result = await asyncio.wait_for(self._in_slot(make), timeout_s)
            else:
                # One is free (checked above): returns at once. The call runs on in its own
                # task when the budget cuts the request's wait short, so its connection goes back
                # to the pool with the reply instead of being dropped (a cancelled redis-py call
                # disconnects, and the next call paid a connect: the largest cost in the router's
                # profile under load); it keeps its slot until then, so the cap still holds.
                await self._slots.acquire()
                call = asyncio.ensure_future(make())
                self._calls.add(call)
                call.add_done_callback(self._call_done)
                result = await asyncio.wait_for(asyncio.shield(call), timeout_s)
        except Exception as exc:
            # Any failure (timeout, connection refused or reset, server error, a slot moving)
            # is a non-answer; the backoff keeps an outage from costing every request a timeout.
            self.stats.num_errors += 1
            backoff_s = self._next_backoff_s.get(shard, self.backoff_s)
            self._down_until[shard] = self.monotonic() + backoff_s
            self._next_backoff_s[shard] = min(backoff_s * 2, self.max_backoff_s)
            log.debug("hint index call failed: %r", exc)
            self._after_error()
            return None
        self._down_until.pop(shard, None)
        self._next_backoff_s.pop(shard, None)
        return result

    def _call_done(self, call: asyncio.Future[Any]) -> None:
        self._calls.discard(call)
        self._slots.release()
        if not call.cancelled():
            call.exception()  # retrieved: a late failure was counted when the budget ran out

    async def _in_slot(self, make: Callable[[], Awaitable[Any]]) -> Any:
        async with self._slots:
            return await make()

    async def publish(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        if not hashes:
            return
        expiry = repr(self.clock() + self.ttl_s)
        ttl = max(1, int(self.ttl_s))
        keys = [self._block_key(h, tenant) for h in hashes]
        # One script call, one reply: a pipeline of ZADD + EXPIRE per block costs a parsed
        # reply per command (and, on a cluster, a slot computation per command) in Python.
        done = await self._call(
            lambda: self._publish_script(keys=keys, args=[expiry, host, ttl]),
            self.write_timeout_s, self._shard(keys[0]))
        if done is not None:
            self.stats.num_published += len(hashes)

    async def withdraw(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        if not hashes:
            return
        keys = [self._block_key(h, tenant) for h in hashes]
        done = await self._call(lambda: self._withdraw_script(keys=keys, args=[host]),
                                self.write_timeout_s, self._shard(keys[0]))
        if done is not None:
            self.stats.num_withdrawn += len(hashes)

    async def lookup(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> list[frozenset[str]]:
        self.stats.num_lookups += 1
        if not hashes:
            return []
        now = self.clock()
        keys = [self._block_key(h, tenant) for h in hashes]

        def build(pipe: Any) -> None:
            for key in keys:
                pipe.zrangebyscore(key, f"({now!r}", "+inf")

        result = await self._call(lambda: self._pipeline(build), self.lookup_budget_s,
                                  self._shard(keys[0]), wait=False)
        if result is None:
            return [frozenset()] * len(hashes)
        return [frozenset(_text(m) for m in members) for members in result]

    async def lookup_runs(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> dict[str, int]:
        self.stats.num_lookups += 1
        if not hashes:
            return {}
        # The chain goes as one argument (the hashes' hex, joined) and the script names the
        # keys: 125 key names built in Python and packed by redis-py were the largest part of
        # the router's cost of a lookup. The first key is declared, so a cluster client sends
        # the call to its slot's master; the others share its tenant's hash tag, hence its slot.
        width = len(hashes[0])
        if any(len(h) != width for h in hashes):
            raise ValueError("block hashes of one chain must have one length")
        names = [self._name(h) for h in hashes]
        chain = b"".join(names)
        prefix = self._block_prefix(tenant)
        first = prefix + names[0].hex()
        args = [repr(self.clock()), prefix, chain.hex(), 2 * len(names[0])]
        flat = await self._call(
            lambda: self._runs_script(keys=[first], args=args), self.lookup_budget_s,
            self._shard(first), wait=False,
        )
        if not flat:
            return {}
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}

    async def register_host(self, host: str, url: str) -> None:
        ttl = max(1, int(self.ttl_s))
        key = self._host_key(host)
        await self._call(lambda: self._client.set(key, url, ex=ttl), self.write_timeout_s,
                         self._shard(key))

    async def host_url(self, host: str) -> str | None:
        key = self._host_key(host)
        result = await self._call(lambda: self._client.get(key), self.write_timeout_s,
                                  self._shard(key))
        return None if result is None else _text(result)

    async def close(self) -> None:
        for call in list(self._calls):
            call.cancel()
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._warming
        try:
            await self._client.aclose()
        except Exception as exc:
            log.debug("closing the hint index: %r", exc)


def split_seed_urls(text: str) -> tuple[str, ...]:
    """Seed URLs of a Redis Cluster from a comma- or space-separated list; checked by
    `RedisClusterHintIndex.from_urls`."""
    return tuple(u for u in text.replace(",", " ").split() if u)


def tenant_tag(tenant: str | None, hint_key: bytes | None = None) -> str:
    """The Redis Cluster hash tag of `tenant`'s block keys (braces included). A digest, not the
    name: names may hold braces, and digests spread tenants evenly over the 16,384 slots. With
    the fleet's `hint_key` the digest is keyed: a reader of Redis cannot confirm a guessed name."""
    if tenant is None:
        return "{t-}"
    digest = hashlib.blake2b(tenant.encode(), key=hint_key or b"", digest_size=8)
    return "{t" + digest.hexdigest() + "}"


class RedisClusterHintIndex(RedisHintIndex):
    """The shared index on a Redis Cluster: `client` is a `redis.asyncio.cluster.RedisCluster`;
    use `from_urls` with seed nodes (any few of the cluster's nodes)."""

    @classmethod
    def from_urls(cls, urls: Sequence[str], **kwargs: Any) -> RedisClusterHintIndex:
        """`urls`: seed nodes, `redis://[[user]:password@]host:port` each (one cluster, one
        password; the first URL's credentials are used)."""
        from urllib.parse import urlsplit

        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        if not urls:
            raise ValueError("a Redis Cluster needs at least one seed URL")
        parts = [urlsplit(u) for u in urls]
        for url, part in zip(urls, parts, strict=True):
            if part.scheme not in ("redis", "rediss") or not part.hostname:
                raise ValueError(f"a Redis Cluster seed must be redis://host:port, got {url!r}")
        first = parts[0]
        connect_timeout_s = kwargs.pop("connect_timeout_s", 0.5)
        kwargs.setdefault("max_connections", REDIS_MAX_CONNECTIONS)
        client = RedisCluster(
            startup_nodes=[ClusterNode(p.hostname or "", p.port or 6379) for p in parts],
            username=first.username or None,
            password=first.password or None,
            ssl=first.scheme == "rediss",
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=kwargs.get("write_timeout_s", 0.5),
            # Retries belong to the caller's budget, not to the client: one try, then backoff.
            retry=Retry(NoBackoff(), 0),
            max_connections=kwargs["max_connections"],  # per master
        )
        return cls(client, **kwargs)

    def _block_prefix(self, tenant: str | None = None) -> str:
        return f"{super()._block_prefix(tenant)}{tenant_tag(tenant, self.hint_key)}:"

    def _shard(self, key: str) -> str:
        try:
            return str(self._client.get_node_from_key(key).name)
        except Exception:  # no slot map yet (not initialized, or a refresh pending)
            return "?"

    async def _load_scripts(self) -> None:
        # The slot map first (a failover or a migration moved slots); SCRIPT LOAD then goes to
        # every master.
        await self._client.initialize()
        await super()._load_scripts()


_PUBLISH_LUA = """
for _, key in ipairs(KEYS) do
  redis.call('ZADD', key, ARGV[1], ARGV[2])
  redis.call('EXPIRE', key, ARGV[3])
end
return #KEYS
"""

_WITHDRAW_LUA = """
for _, key in ipairs(KEYS) do
  redis.call('ZREM', key, ARGV[1])
end
return #KEYS
"""

_RUNS_LUA = """
local bound = '(' .. ARGV[1]
local prefix, chain, width = ARGV[2], ARGV[3], tonumber(ARGV[4])
local alive = nil
local runs = {}
for i = 1, #chain / width do
  local key = prefix .. string.sub(chain, (i - 1) * width + 1, i * width)
  local next_alive = {}
  local any = false
  for _, host in ipairs(redis.call('ZRANGEBYSCORE', key, bound, '+inf')) do
    if alive == nil or alive[host] then
      next_alive[host] = true
      runs[host] = i
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for host, n in pairs(runs) do
  out[#out + 1] = host
  out[#out + 1] = n
end
return out
"""


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value
