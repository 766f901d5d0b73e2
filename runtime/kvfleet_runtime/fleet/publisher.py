"""Batches a replica's "stored"/"removed" block events into hint-index writes, off the request path.

`offer_stored` / `offer_removed` are synchronous, O(1) and never block: they are called from the
cache's listener, on whatever thread caused the event. A background task flushes a batch every
`flush_interval_s` (or sooner when `batch_size` hashes are pending). Later offers of a hash replace
earlier ones (a store then an evict in one interval sends only the withdrawal). Past `max_pending`
hashes, new offers are dropped and counted: a lost hint costs one missed T2 opportunity or one
stale lookup, never correctness. Each hash carries the tenant it was stored for, and a flush sends
one publish (and one withdraw) per tenant: on Redis Cluster a tenant's keys share one slot.

Re-publishing keeps hints of long-lived blocks alive past their TTL: the replica re-offers the
blocks of every local hit, and `refresh_after_s` suppresses re-sending a hash published recently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvfleet_runtime.background import Supervisor
from kvfleet_runtime.fleet.hint_index import HintIndex

__all__ = ["HintPublisher", "PublisherStats"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PublisherStats:
    num_offered: int = 0
    num_dropped: int = 0
    num_flushes: int = 0


class HintPublisher:
    def __init__(
        self,
        index: HintIndex,
        host: str,
        *,
        batch_size: int = 512,
        flush_interval_s: float = 0.05,
        max_pending: int = 1 << 16,
        refresh_after_s: float = 300.0,
        max_recent: int = 1 << 18,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.host = host
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self.refresh_after_s = refresh_after_s
        self.max_recent = max_recent
        self.clock = clock
        self.stats = PublisherStats()
        # hash -> (stored?, tenant)
        self._pending: OrderedDict[bytes, tuple[bool, str | None]] = OrderedDict()
        self._recent: OrderedDict[bytes, float] = OrderedDict()  # hash -> last published at
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        # One flush at a time: a batch is popped before it is sent, so without this an explicit
        # flush() finding nothing pending could return while the background flush still has the
        # last batch in flight, and a caller that flushed could look its hashes up and miss.
        self._flushing = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    # -- producers (any thread) --------------------------------------------------------------

    def offer_stored(
        self, hashes: Iterable[bytes], *, refresh: bool = False, tenant: str | None = None
    ) -> None:
        """Hashes (of `tenant`'s chains) now held here. With `refresh`, skip those published in
        the last `refresh_after_s` (used to keep hints of hit blocks alive)."""
        now = self.clock()
        with self._lock:
            for h in hashes:
                if refresh:
                    last = self._recent.get(h)
                    if last is not None and now - last < self.refresh_after_s:
                        continue
                self._offer(h, True, tenant)
        self._poke()

    def offer_removed(self, hashes: Iterable[bytes], *, tenant: str | None = None) -> None:
        with self._lock:
            for h in hashes:
                self._recent.pop(h, None)
                self._offer(h, False, tenant)
        self._poke()

    def _offer(self, h: bytes, stored: bool, tenant: str | None) -> None:
        self.stats.num_offered += 1
        if h in self._pending or len(self._pending) < self.max_pending:
            self._pending[h] = (stored, tenant)
        else:
            self.stats.num_dropped += 1

    def _poke(self) -> None:
        loop = self._loop
        if loop is not None and len(self._pending) >= self.batch_size:
            with contextlib.suppress(RuntimeError):  # loop closed: the flush loop is gone too
                loop.call_soon_threadsafe(self._wake.set)

    # -- consumer (the event loop) ------------------------------------------------------------

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Start the flush loop, as a loop of `supervisor` (the replica's: a loop that dies is
        logged and restarted); a private one when None."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._flushing = asyncio.Lock()
        supervisor = Supervisor() if supervisor is None else supervisor
        self._task = supervisor.start(f"hint-publisher-{self.host}", self._run)

    async def close(self) -> None:
        """Stop the background task after one last flush."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> None:
        """Send everything pending now (per batch, one publish and one withdraw call per
        tenant). On return every offer made before the call has been sent, including a batch the
        background task had in flight."""
        async with self._flushing:
            await self._flush_pending()

    async def _flush_pending(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                batch = [
                    self._pending.popitem(last=False)
                    for _ in range(min(self.batch_size, len(self._pending)))
                ]
            stored: dict[str | None, list[bytes]] = {}
            removed: dict[str | None, list[bytes]] = {}
            for h, (is_stored, tenant) in batch:
                (stored if is_stored else removed).setdefault(tenant, []).append(h)
            for tenant, hashes in stored.items():
                await self.index.publish(self.host, hashes, tenant=tenant)
            if stored:
                now = self.clock()
                with self._lock:
                    for hashes in stored.values():
                        for h in hashes:
                            self._recent[h] = now
                            self._recent.move_to_end(h)
                    while len(self._recent) > self.max_recent:
                        self._recent.popitem(last=False)
            for tenant, hashes in removed.items():
                await self.index.withdraw(self.host, hashes, tenant=tenant)
            self.stats.num_flushes += 1

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("hint publisher flush failed")
