"""The reuse-time ranking: evict the block predicted to be needed again last.

A prefix cache wants Belady's choice (drop the block whose next request is farthest away) without
knowing the future. This ranking predicts it from what the cache sees, online, in one number per
block that stays fixed until the block is seen again (so a lazy heap orders it, as the other
rankings, and a victim costs one pop), its credited last use:

    credit = last use + horizon x log2(sightings)
    predicted time to the next use = now - credit   (the longer unused, the longer still)

so the smallest credit goes first: the block predicted to come back farthest away.

- `last use` (the index's tick of the block's last lookup, touch or store) is recency: a block
  not asked for since long is predicted to come back late, as LRU assumes;
- `sightings` (the count-min sketch, never capped below its 255) is frequency: a prefix seen 2^k
  times is predicted to come back k horizons sooner than one seen once (on the Mooncake trace
  re-requests grow like preferential attachment: the blocks asked most so far are asked next);
- `horizon` is learned, not set: the mean age (ticks since last use) of the cache's own recent
  victims, an EWMA over `HORIZON_WEIGHT`. It is the cache's characteristic time (Che's
  approximation): how long an unasked block survives here. One more doubling of sightings buys a
  block one more such lifetime. A big cache has a long horizon and ranks by frequency over a long
  history; a small one a short horizon, where recency matters as much. It starts at 0 (plain
  LRU, as vLLM) and grows with the first evictions.

The duel (bypass): a newcomer's credit is `now + horizon x log2(its sightings)`; a victim with
more credit (predicted to be needed sooner, `outranks`) keeps its slot and the newcomer is not
stored. A one-shot block (one sighting) therefore only displaces blocks whose credit has run out:
blocks the cache has not used for longer than their sightings earn.

The ranking competes with the capped-count rankings in the ghosts' duel (`AdaptiveRanking`):
`GhostReuse` is its ghost, the same prediction over a flat directory of hashes. Measured figures
(and the mechanisms that did not make it): docs/cache.md.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvfleet_runtime.cache._eviction import Evictable, VictimQueue
from kvfleet_runtime.cache._sketch import CountMinSketch

if TYPE_CHECKING:
    from kvfleet_runtime.cache._block_node import BlockNode

__all__ = ["HORIZON_WEIGHT", "REUSE_RANKING", "GhostReuse", "Horizon", "ReuseEviction"]

REUSE_RANKING = "reuse"
"""Its name among `CacheTuning.eviction_rankings` (the others are sighting caps)."""

HORIZON_WEIGHT = 1.0 / 256
"""Weight of one victim's age in the horizon's EWMA: the horizon follows the last few hundred
evictions, i.e. a change of load within about one request's worth of victims on a long prompt."""

_LOG2 = [0.0] + [math.log2(n) for n in range(1, 256)]
"""log2 of every sketch count (counters are bytes)."""


class Horizon:
    """The cache's characteristic time, learned from its victims: an EWMA of their age."""

    __slots__ = ("now", "ticks")

    def __init__(self) -> None:
        self.ticks = 0.0
        self.now = 0
        """The latest tick seen (a pushed block's `last_tick`, or a ghost's own tick)."""

    def evicted(self, last_tick: int) -> None:
        self.ticks += (max(0, self.now - last_tick) - self.ticks) * HORIZON_WEIGHT

    def key(self, last_tick: int, sightings: int) -> int:
        """The credited last use (the ranking's order: smallest goes first)."""
        return last_tick + int(self.ticks * _LOG2[sightings if sightings < 256 else 255])


class _ReuseQueue(VictimQueue):
    """One tier's lazy heap ordered by credit. The entry's weight is the credit: it
    only grows while the block stays (its sightings grow, the horizon mostly grows), so
    `VictimQueue.pop`'s re-ranking of entries whose weight grew keeps the order right."""

    def __init__(self, sketch: CountMinSketch, horizon: Horizon) -> None:
        super().__init__(sketch, max_frequency=None)
        self.horizon = horizon

    def _weight(self, node: BlockNode) -> int:
        return self.horizon.key(node.last_tick, self.node_frequency(node))


class ReuseEviction:
    """The block predicted to be needed again last (least credit) goes first, unpinned first; a
    newcomer takes a victim's slot only if it has at least the victim's credit (module doc)."""

    __slots__ = ("_queues", "horizon", "sketch")

    max_frequency = None
    """Sightings are never capped (the prediction uses their log)."""

    def __init__(self, sketch: CountMinSketch, *, num_tiers: int = 2) -> None:
        self.sketch = sketch
        self.horizon = Horizon()
        self._queues = [_ReuseQueue(sketch, self.horizon) for _ in range(num_tiers)]

    def num_queued(self, tier: int) -> int:
        return len(self._queues[tier])

    def push(self, node: BlockNode, evictable: Evictable) -> None:
        horizon = self.horizon
        horizon.now = max(horizon.now, node.last_tick)
        self._queues[node.tier].push(node, evictable)

    def pop(self, tier: int, evictable: Evictable) -> BlockNode | None:
        node = self._queues[tier].pop(evictable)
        if node is not None:
            self.horizon.evicted(node.last_tick)
        return node

    def candidate_weights(self, hashes: Sequence[bytes]) -> list[int]:
        horizon = self.horizon
        now = horizon.now + 1  # the tick the index gives the blocks it is about to insert
        return [horizon.key(now, f) for f in self.sketch.estimate_many(hashes)]

    def outranks(self, victim: BlockNode, weight: int) -> bool:
        """More credit than the newcomer (predicted to be needed sooner): it stays."""
        return self._queues[0]._weight(victim) > weight

    def fill(self, tier: int, nodes: Iterable[BlockNode]) -> None:
        nodes = list(nodes)
        horizon = self.horizon
        for node in nodes:
            horizon.now = max(horizon.now, node.last_tick)
        self._queues[tier].fill(nodes)


class GhostReuse:
    """`ReuseEviction`'s ghost for `AdaptiveRanking`: what the prediction would hold at this
    capacity, as a flat directory of (sampled) block hashes, one tick per offered chain, every
    offered block admitted (as `GhostRanking`: the ghost measures eviction order)."""

    __slots__ = ("_heap", "_where", "capacity_blocks", "horizon", "limit", "sample")

    max_frequency = None
    label = REUSE_RANKING

    def __init__(self, capacity_blocks: int, *, sample: int = 1) -> None:
        if capacity_blocks < 1 or sample < 1 or sample & (sample - 1):
            raise ValueError(
                f"need capacity_blocks >= 1 and sample a power of two, got {capacity_blocks} "
                f"and {sample}"
            )
        self.capacity_blocks = capacity_blocks
        self.sample = sample
        self.limit = max(1, capacity_blocks // sample)
        self.horizon = Horizon()
        self._where: dict[bytes, int] = {}
        """Block hash -> the tick of its entry (the one valid entry of the heap)."""
        self._heap: list[tuple[int, int, bytes]] = []
        """(credit, tick, hash); stale once the hash's tick moved on."""

    def eviction(self, sketch: CountMinSketch) -> ReuseEviction:
        return ReuseEviction(sketch)

    def replay(self, hashes: Sequence[bytes], counts: Sequence[int]) -> int:
        """`GhostRanking.replay`: match, then offer (the sampled blocks head first, counts after
        this sighting); returns the blocks of the leading run that was present, scaled back."""
        where, heap, horizon = self._where, self._heap, self.horizon
        horizon.now += 1
        tick = horizon.now
        first_absent = len(hashes)
        for i in range(len(hashes) - 1, -1, -1):
            h, count = hashes[i], counts[i]
            if h not in where:
                first_absent = i
            where[h] = tick
            heapq.heappush(heap, (horizon.key(tick, count), tick, h))
        excess = len(where) - self.limit
        while excess > 0:
            _, entry_tick, h = heapq.heappop(heap)
            if where.get(h) == entry_tick:
                del where[h]
                horizon.evicted(entry_tick)
                excess -= 1
        if len(heap) > 4 * len(where) + 1024:
            self._heap = heap = [e for e in heap if where.get(e[2]) == e[1]]
            heapq.heapify(heap)
        return first_absent * self.sample

    def __len__(self) -> int:
        return len(self._where)
