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
  redis-py). It runs under `lookup_budget_s`. The keys of one lookup must live on one Redis
  (no Cluster slot spreading). After a failure the index stops asking Redis for a backoff
  period (doubling to `max_backoff_s`), so an outage costs each request nothing, not a timeout.
  Host names and clocks: expiry is the publisher's wall clock; skew between hosts only shifts
  staleness, which is already allowed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "DEFAULT_TTL_S",
    "EmbeddedHintIndex",
    "HintIndex",
    "HintIndexStats",
    "RedisHintIndex",
    "best_peer",
    "leading_runs",
]

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 900.0
"""How long a published hint lives unless re-published (a held block is re-offered on use)."""


@dataclass(slots=True)
class HintIndexStats:
    num_lookups: int = 0
    num_published: int = 0
    num_withdrawn: int = 0
    num_errors: int = 0
    """Failed or timed-out calls (each answered "nobody" or dropped)."""
    num_skipped: int = 0
    """Calls not attempted because the index is backing off after an error."""


class HintIndex(Protocol):
    stats: HintIndexStats

    async def publish(self, host: str, hashes: Sequence[bytes]) -> None:
        """Announce that `host` holds `hashes`; best effort."""

    async def withdraw(self, host: str, hashes: Sequence[bytes]) -> None:
        """Announce that `host` dropped `hashes`; best effort."""

    async def lookup(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> list[frozenset[str]]:
        """Hosts listed for each hash (same length as `hashes`); all empty on any failure.
        `tenant`: whose chain `hashes` is (the peer-probe index needs it for the credential;
        the others ignore it)."""

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

    async def publish(self, host: str, hashes: Sequence[bytes]) -> None:
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

    async def withdraw(self, host: str, hashes: Sequence[bytes]) -> None:
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
    """The shared index in Redis. `client` is a `redis.asyncio.Redis`; use `from_url`."""

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
    ) -> None:
        self._client = client
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.lookup_budget_s = lookup_budget_s
        self.write_timeout_s = write_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.monotonic = monotonic
        self.stats = HintIndexStats()
        self._down_until = 0.0
        self._next_backoff_s = backoff_s
        self._runs_script = client.register_script(_RUNS_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisHintIndex:
        from redis.asyncio import Redis

        connect_timeout_s = kwargs.pop("connect_timeout_s", 0.5)
        client = Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=kwargs.get("write_timeout_s", 0.5),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        return cls(client, **kwargs)

    @property
    def available(self) -> bool:
        """False while backing off after an error."""
        return self.monotonic() >= self._down_until

    def _block_key(self, h: bytes) -> str:
        return f"{self.namespace}:b:{h.hex()}"

    def _host_key(self, host: str) -> str:
        return f"{self.namespace}:h:{host}"

    async def _pipeline(self, build: Callable[[Any], None]) -> list[Any]:
        async with self._client.pipeline(transaction=False) as pipe:
            build(pipe)
            result: list[Any] = await pipe.execute()
        return result

    async def _run(self, build: Callable[[Any], None], timeout_s: float) -> list[Any] | None:
        return await self._call(lambda: self._pipeline(build), timeout_s)

    async def _call(
        self, make: Callable[[], Awaitable[list[Any]]], timeout_s: float
    ) -> list[Any] | None:
        if not self.available:
            self.stats.num_skipped += 1
            return None
        try:
            result = await asyncio.wait_for(make(), timeout_s)
        except Exception as exc:
            # Any failure (timeout, connection refused or reset, server error) is a
            # non-answer; the backoff keeps an outage from costing every request a timeout.
            self.stats.num_errors += 1
            self._down_until = self.monotonic() + self._next_backoff_s
            self._next_backoff_s = min(self._next_backoff_s * 2, self.max_backoff_s)
            log.debug("hint index call failed: %r", exc)
            return None
        self._next_backoff_s = self.backoff_s
        return result

    async def publish(self, host: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return
        expiry = self.clock() + self.ttl_s
        ttl = max(1, int(self.ttl_s))

        def build(pipe: Any) -> None:
            for h in hashes:
                key = self._block_key(h)
                pipe.zadd(key, {host: expiry})
                pipe.expire(key, ttl)

        if await self._run(build, self.write_timeout_s) is not None:
            self.stats.num_published += len(hashes)

    async def withdraw(self, host: str, hashes: Sequence[bytes]) -> None:
        if not hashes:
            return

        def build(pipe: Any) -> None:
            for h in hashes:
                pipe.zrem(self._block_key(h), host)

        if await self._run(build, self.write_timeout_s) is not None:
            self.stats.num_withdrawn += len(hashes)

    async def lookup(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> list[frozenset[str]]:
        self.stats.num_lookups += 1
        if not hashes:
            return []
        now = self.clock()

        def build(pipe: Any) -> None:
            for h in hashes:
                pipe.zrangebyscore(self._block_key(h), f"({now!r}", "+inf")

        result = await self._run(build, self.lookup_budget_s)
        if result is None:
            return [frozenset()] * len(hashes)
        return [frozenset(_text(m) for m in members) for members in result]

    async def lookup_runs(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> dict[str, int]:
        self.stats.num_lookups += 1
        if not hashes:
            return {}
        keys = [self._block_key(h) for h in hashes]
        now = repr(self.clock())
        flat = await self._call(
            lambda: self._runs_script(keys=keys, args=[now]), self.lookup_budget_s
        )
        if not flat:
            return {}
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}

    async def register_host(self, host: str, url: str) -> None:
        ttl = max(1, int(self.ttl_s))
        await self._run(
            lambda pipe: pipe.set(self._host_key(host), url, ex=ttl), self.write_timeout_s
        )

    async def host_url(self, host: str) -> str | None:
        result = await self._run(lambda pipe: pipe.get(self._host_key(host)), self.write_timeout_s)
        return None if not result or result[0] is None else _text(result[0])

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except Exception as exc:
            log.debug("closing the hint index: %r", exc)


_RUNS_LUA = """
local bound = '(' .. ARGV[1]
local alive = nil
local runs = {}
for i, key in ipairs(KEYS) do
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
