"""Hint publisher: batching, last-offer-wins, bounded queue, refresh suppression, thread safety."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from kvfleet_runtime.fleet import EmbeddedHintIndex, HintPublisher

H = [i.to_bytes(16, "big") for i in range(64)]


async def test_flush_publishes_and_withdraws_last_offer_wins() -> None:
    index = EmbeddedHintIndex()
    pub = HintPublisher(index, "r1")
    pub.offer_stored(H[:4])
    pub.offer_removed(H[2:3])  # stored then removed in one interval: only the withdrawal
    await pub.flush()
    assert await index.lookup(H[:4]) == [frozenset({"r1"})] * 2 + [frozenset(), frozenset({"r1"})]
    assert index.stats.num_published == 3 and index.stats.num_withdrawn == 1


async def test_bounded_pending_drops_new_offers() -> None:
    pub = HintPublisher(EmbeddedHintIndex(), "r1", max_pending=4)
    pub.offer_stored(H[:6])
    assert pub.num_pending == 4 and pub.stats.num_dropped == 2
    pub.offer_removed(H[:1])  # an update to a pending hash is never dropped
    assert pub.stats.num_dropped == 2


async def test_refresh_skips_recently_published() -> None:
    now = [0.0]
    index = EmbeddedHintIndex()
    pub = HintPublisher(index, "r1", refresh_after_s=100, clock=lambda: now[0])
    pub.offer_stored(H[:2])
    await pub.flush()
    pub.offer_stored(H[:3], refresh=True)
    assert pub.num_pending == 1  # only H[2] is new
    now[0] = 101
    pub.offer_stored(H[:3], refresh=True)
    assert pub.num_pending == 3


async def test_background_task_flushes_offers_from_other_threads() -> None:
    index = EmbeddedHintIndex()
    pub = HintPublisher(index, "r1", batch_size=8, flush_interval_s=0.01)
    pub.start()
    try:
        threads = [
            threading.Thread(target=pub.offer_stored, args=(H[i * 16 : (i + 1) * 16],))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for _ in range(200):
            if pub.num_pending == 0 and index.stats.num_published == 64:
                break
            await asyncio.sleep(0.01)
        assert await index.lookup(H) == [frozenset({"r1"})] * 64
    finally:
        await pub.close()


class _SlowIndex(EmbeddedHintIndex):
    """Holds every publish until `release` is set: a Redis round trip that takes a while."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def publish(
        self, host: str, hashes: Sequence[bytes], *, tenant: str | None = None
    ) -> None:
        self.entered.set()
        await self.release.wait()
        await super().publish(host, hashes, tenant=tenant)


async def test_flush_waits_for_the_batch_the_background_task_has_in_flight() -> None:
    index = _SlowIndex()
    pub = HintPublisher(index, "r1", flush_interval_s=0.01)
    pub.start()
    try:
        pub.offer_stored(H[:4])
        await asyncio.wait_for(index.entered.wait(), 5)  # the background flush took the batch
        assert pub.num_pending == 0
        explicit = asyncio.create_task(pub.flush())
        await asyncio.sleep(0.05)
        assert not explicit.done()  # nothing pending, but the batch is not sent yet
        index.release.set()
        await asyncio.wait_for(explicit, 5)
        assert await index.lookup(H[:4]) == [frozenset({"r1"})] * 4
    finally:
        index.release.set()
        await pub.close()
