"""The peer-probe hint index: no Redis, but the replica knows its peers (the fleet config's
replica list), so a lookup asks each peer directly how much of the chain it holds.

    index = PeerProbeHintIndex(secret, peers=lambda: {"r1": "http://127.0.0.1:8001"},
                               self_host="r0")
    runs = await index.lookup_runs(chain, tenant="acme")    # {"r1": 12}: r1 holds blocks 0..11

Each peer answers `POST /kv/v1/held` (`fleet.t2_serve`): the tenant header, the same tenant-scoped
bearer credential as T2, and the chain's hashes (at most `MAX_PROBE_BLOCKS`) -> how many leading
blocks of that chain it holds for that tenant (from its own cache events). All peers are asked
at once, under `lookup_budget_s`; a peer that fails, refuses (401/403/503) or does not answer in
time holds nothing for this lookup. Like every hint index it never raises and is never a source
of truth: the fetch that follows verifies every block against the chain.

Costs and limits:

- One small HTTP request per peer per local miss (only when the miss is long enough to be worth
  a fetch: `FleetSettings.min_fetch_blocks`), so this suits a handful of replicas (one machine,
  a small fleet); a larger fleet should configure Redis, which answers in one round trip.
- The lookup waits for the slowest peer, up to the budget (default `DEFAULT_PROBE_BUDGET_S`,
  50 ms: a lookup asking two idle peers on loopback took p50 1.2 ms, p90 1.5 ms on the shared
  2-core box; a replica busy prefilling on a shared CPU can take tens of ms to answer, and prompts
  worth fetching take far longer than that to prefill on CPU). A peer that errs (refused, reset,
  bad answer) is skipped for a backoff period (doubling, up to `max_backoff_s`), so a dead peer
  costs lookups nothing; a peer that is only slow is asked again next time (it costs at most the
  budget).
- publish/withdraw/register_host are no-ops: each peer answers for its own blocks, so nothing
  needs publishing and nothing goes stale beyond the peer's own eviction races (which the fetch
  tolerates: a 404 or a shorter run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

from kvfleet_runtime.fleet.hint_index import HintIndexStats
from kvfleet_runtime.fleet.t2_protocol import MAX_PROBE_BLOCKS, peer_token
from kvfleet_runtime.wire import HELD_PATH, TENANT_HEADER

__all__ = ["DEFAULT_PROBE_BUDGET_S", "PeerProbeHintIndex"]

log = logging.getLogger(__name__)

DEFAULT_PROBE_BUDGET_S = 0.05
"""Default lookup budget of the peer probe (KVFLEET_HINT_LOOKUP_BUDGET_S overrides it)."""


class _ProbeFailed(Exception):
    pass


class PeerProbeHintIndex:
    """`HintIndex` that asks the peers themselves. `peers()` -> {name: base URL}, read on every
    lookup (so a reloaded fleet config applies at once); `self_host` is never asked."""

    def __init__(
        self,
        secret: bytes | None,
        peers: Callable[[], Mapping[str, str]],
        self_host: str,
        *,
        lookup_budget_s: float = DEFAULT_PROBE_BUDGET_S,
        max_concurrency: int = 16,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        session: aiohttp.ClientSession | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.secret = secret
        self.peers = peers
        self.self_host = self_host
        self.lookup_budget_s = lookup_budget_s
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.monotonic = monotonic
        self.stats = HintIndexStats()
        self._session = session
        self._own_session = session is None
        self._down_until: dict[str, float] = {}
        self._next_backoff: dict[str, float] = {}
        self._pending: set[asyncio.Task[Any]] = set()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # The connector's limit bounds the probes in flight; connections are kept alive.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency),
                timeout=aiohttp.ClientTimeout(total=max(1.0, 10 * self.lookup_budget_s)),
            )
            self._own_session = True
        return self._session

    async def publish(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        return None

    async def withdraw(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        return None

    async def register_host(self, host: str, url: str) -> None:
        return None

    async def host_url(self, host: str) -> str | None:
        try:
            return self.peers().get(host)
        except Exception:
            return None

    async def lookup(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> list[frozenset[str]]:
        runs = await self.lookup_runs(hashes, tenant=tenant)
        return [frozenset(h for h, n in runs.items() if n > i) for i in range(len(hashes))]

    async def lookup_runs(
        self, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> dict[str, int]:
        self.stats.num_lookups += 1
        if not hashes or not tenant or not self.secret:
            return {}
        try:
            return await self._lookup_runs(list(hashes[:MAX_PROBE_BLOCKS]), tenant)
        except Exception as exc:  # a hint: never raise into the request path
            self.stats.num_errors += 1
            log.debug("peer probe failed: %r", exc)
            return {}

    async def _lookup_runs(self, hashes: list[bytes], tenant: str) -> dict[str, int]:
        assert self.secret
        now = self.monotonic()
        targets: dict[str, str] = {}
        for name, url in self.peers().items():
            if name == self.self_host:
                continue
            if self._down_until.get(name, 0.0) > now:
                self.stats.num_skipped += 1
                continue
            targets[name] = url
        if not targets:
            return {}
        body = json.dumps({"block_hashes": [h.hex() for h in hashes]}).encode()
        headers = {
            TENANT_HEADER: tenant,
            "Authorization": f"Bearer {peer_token(self.secret, tenant)}",
            "Content-Type": "application/json",
        }
        session = self._client()
        tasks = {
            asyncio.ensure_future(self._probe(session, url, body, headers, len(hashes))): name
            for name, url in targets.items()
        }
        done, pending = await asyncio.wait(tasks, timeout=self.lookup_budget_s)
        for task in pending:  # too slow for this lookup: it holds nothing (no backoff)
            self.stats.num_errors += 1
            task.cancel()
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        runs: dict[str, int] = {}
        for task in done:
            name = tasks[task]
            exc = task.exception()
            if exc is not None:
                self.stats.num_errors += 1
                self._back_off(name)
                log.debug("peer probe of %s failed: %r", name, exc)
                continue
            self._next_backoff.pop(name, None)
            n: int = task.result()
            if n > 0:
                runs[name] = n
        return runs

    def _back_off(self, name: str) -> None:
        delay = self._next_backoff.get(name, self.backoff_s)
        self._down_until[name] = self.monotonic() + delay
        self._next_backoff[name] = min(delay * 2, self.max_backoff_s)

    @staticmethod
    async def _probe(
        session: aiohttp.ClientSession,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        num_hashes: int,
    ) -> int:
        async with session.post(url.rstrip("/") + HELD_PATH, data=body, headers=headers) as resp:
            if resp.status != 200:
                raise _ProbeFailed(f"HTTP {resp.status}")
            answer = await resp.json()
        n = answer.get("leading_blocks") if isinstance(answer, dict) else None
        if type(n) is not int or not 0 <= n <= num_hashes:
            raise _ProbeFailed(f"bad answer {answer!r}")
        return n

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._own_session and self._session is not None and not self._session.closed:
            await self._session.close()
