"""Victim choice: which evictable block goes first, and whether a newcomer may take its slot.
The policy half of eviction, apart from the index (which knows blocks, chains, refs and tiers and
decides what is evictable).

In the manner of vLLM's free-block queue and SGLang's `evict_policy.py`, the index talks to an
`EvictionPolicy` through five calls: it pushes a block whenever the block may have become
evictable (released, touched, its last child gone), pops the first valid one of a tier when it
needs room, asks the policy for the weight of the blocks it wants to place (`candidate_weights`)
and whether a victim outranks such a candidate (`outranks`: the TinyLFU duel; the newcomer is
refused its slot), and hands a new policy every evictable block when the cache switches ranking
(`fill`). The policy never decides evictability itself: it asks the `evictable` predicate it is
given.

`RankedEviction` is the one ranking the cache ships: (unpinned first, lowest capped sighting
count, least recent, oldest push). Its cap is a constructor argument: 1 is plain LRU (vLLM's free
queue; every count ranks alike, so the duel never refuses anything), None ranks by the raw count.
Another ranking is another instance (`BlockIndex.set_policy`), never a mode flipped in place.

Counts are bounded along the chain (`chain_bound`): every request that holds a block holds its
parent (a chain hash commits to the whole prefix), so a block is never seen more often than its
parent, and the count-min sketch, which only ever over-counts, is corrected by that bound. It
matters because eviction is leaf first: one over-counted leaf at the tail of a chain seen once
would outrank the one-shot newcomers in the duel and keep the whole chain above it in the cache.

Lazy: a block pushed twice has two entries; an entry is stale once its block was touched again
(tick), pinned or unpinned since, or is no longer evictable. A popped entry whose block's count
grew since the push is re-ranked (bounded, so one pop stays cheap).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvfleet_runtime.cache._sketch import MAX_COUNT, CountMinSketch

if TYPE_CHECKING:  # the index imports this module: the node type is only needed for checking
    from kvfleet_runtime.cache._block_node import BlockNode

__all__ = ["EvictionPolicy", "RankedEviction", "VictimQueue", "chain_bound", "floors"]

Evictable = Callable[["BlockNode"], bool]

_Entry = tuple[bool, int, int, int, "BlockNode"]
"""(pinned, aged frequency, last tick, seq, node); smallest goes first."""

_MAX_REFRESH = 32
"""Victim candidates re-ranked per pop before the current best is taken regardless."""

_COMPACT_MIN_ENTRIES = 1024
"""A queue is compacted (stale entries dropped) once it holds this many entries more than 4x
the valid ones it held after its last compaction: lazy entries stay bounded without a scan per
push."""


def chain_bound(counts: list[int], cap: int | None = None) -> list[int]:
    """Sighting estimates of a run of consecutive chain blocks (head first), each bounded by
    the ones before it (and by `cap`): a block is never seen more often than its parent, so
    the running minimum is a tighter upper bound than the count-min sketch's own estimate.

    Why it matters (measured on Mooncake's conversation trace at 10%, 5.7M distinct blocks in
    4M-wide sketch rows): a few percent of the blocks seen once read 2 or more, so a chain seen
    once kept one over-counted block every few dozen; evicted leaf first, it stopped at that
    block, whose count then outranked every one-shot newcomer in the duel (the cache refused
    76% of the blocks offered under `count<=2`) and held the once-seen chain above it. The
    ghosts, flat directories without chains, never saw that, and led the cache into a ranking
    whose real cache hit 0.78-0.93 of its ghost."""
    if cap is None and counts == sorted(counts, reverse=True):
        return counts  # the usual chain, already non-increasing: one pass, no copy
    low = MAX_COUNT if cap is None else cap
    # A comprehension, not `accumulate(counts, min)`: a call per block cost 5x as much.
    return [low := count if count < low else low for count in counts]


def floors(counts: Iterable[int], epoch: int) -> list[int]:
    """Blocks' counts at a sighting, as their `BlockNode.floor`s: `counts[i]` is block i's
    chain-bounded count taken in sketch epoch `epoch` (`CountMinSketch.num_resets`). Counters
    only grow within an epoch, so it stays a floor of the estimate until the next reset, and
    until the block's next sighting it is the block's count (`VictimQueue.node_frequency`)."""
    base = (epoch + 1) << 8
    return [base | count for count in counts]


class EvictionPolicy(Protocol):
    """What the index asks of a victim-choice policy (one per cache, both tiers)."""

    def push(self, node: BlockNode, evictable: Evictable) -> None:
        """`node` may have become evictable in `node.tier` (the caller has checked it is)."""

    def pop(self, tier: int, evictable: Evictable) -> BlockNode | None:
        """The first evictable block of `tier` in ranking order, out of the queue (None: none)."""

    def candidate_weights(self, hashes: Sequence[bytes]) -> list[int]:
        """How much each block about to be placed is worth, in the unit `outranks` compares."""

    def outranks(self, victim: BlockNode, weight: int) -> bool:
        """Whether `victim` is worth more than a candidate of `weight` (the candidate is
        refused the slot)."""

    def fill(self, tier: int, nodes: Iterable[BlockNode]) -> None:
        """Replace `tier`'s queue by these evictable blocks, ranked now."""


class VictimQueue:
    """One tier's lazy heap in `RankedEviction`'s order."""

    def __init__(self, sketch: CountMinSketch, *, max_frequency: int | None) -> None:
        if max_frequency is not None and max_frequency < 1:
            raise ValueError(f"max_frequency must be >= 1 or None, got {max_frequency}")
        self.sketch = sketch
        self.max_frequency = max_frequency
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._compact_at = _COMPACT_MIN_ENTRIES

    def __len__(self) -> int:
        return len(self._heap)

    def frequency(self, block_hash: bytes) -> int:
        """The sketch's estimate, capped at `max_frequency`."""
        freq = self.sketch.estimate(block_hash)
        cap = self.max_frequency
        return freq if cap is None or freq <= cap else cap

    def node_frequency(self, node: BlockNode) -> int:
        """`frequency` of the node's block as of its last sighting: its floor (`BlockNode.floor`)
        while that is of this sketch epoch. The manager sets the floor from the chain-bounded
        count whenever the block is stored or seen again, and a block's count only grows when it
        is seen, so whatever the sketch added since came from other blocks sharing its counters:
        the sketch is not asked (under plain recency, as before, no victim costs an estimate).
        Without a floor of this epoch (none yet, or one from before an aging), the sketch's
        estimate bounded by the parent's (`chain_bound` for one block), kept as the floor."""
        cap = self.max_frequency
        sketch = self.sketch
        floor = node.floor
        if floor >> 8 == sketch.num_resets + 1:
            freq = floor & 0xFF
        else:
            freq = sketch.estimate(node.block_hash)
            parent = node.parent
            if freq > 1 and parent is not None:
                freq = min(freq, sketch.estimate(parent.block_hash))
            node.floor = ((sketch.num_resets + 1) << 8) | freq
        return freq if cap is None or freq <= cap else cap

    def _weight(self, node: BlockNode) -> int:
        """Frequency scaled by 2^(sketch resets so far). Every reset halves all counters, so
        ordering by f * 2^resets_at_push ranks entries pushed in different epochs exactly as
        their aged frequencies would, without ever re-keying the heap."""
        return self.node_frequency(node) << self.sketch.num_resets

    def _entry(self, node: BlockNode) -> _Entry:
        return (node.pinned, self._weight(node), node.last_tick, next(self._seq), node)

    def push(self, node: BlockNode, evictable: Evictable) -> None:
        heapq.heappush(self._heap, self._entry(node))
        self._bound(evictable)

    def _bound(self, evictable: Evictable) -> None:
        if len(self._heap) > self._compact_at:
            # Dropping stale entries never changes the pop order: every valid entry stays,
            # with its key, and the keys (seq last) are a total order.
            self._heap = [e for e in self._heap if self._valid(e, evictable)]
            heapq.heapify(self._heap)
            self._compact_at = 4 * len(self._heap) + _COMPACT_MIN_ENTRIES

    def fill(self, nodes: Iterable[BlockNode]) -> None:
        heap = [self._entry(n) for n in nodes]
        heapq.heapify(heap)
        self._heap = heap
        self._compact_at = 4 * len(heap) + _COMPACT_MIN_ENTRIES

    @staticmethod
    def _valid(entry: _Entry, evictable: Evictable) -> bool:
        pinned, _, tick, _, node = entry
        return node.last_tick == tick and node.pinned == pinned and evictable(node)

    def push_pop(self, node: BlockNode, evictable: Evictable) -> BlockNode | None:
        """`push(node)` then `pop()`, in one step: the victim those two would give."""
        # `_entry` and `node_frequency`'s floor, spelled out: this runs once per block of a
        # chain evicted leaf first.
        resets = self.sketch.num_resets
        cap = self.max_frequency
        floor = node.floor
        if cap is not None and floor >> 8 == resets + 1 and floor & 0xFF >= cap:
            freq = cap
        else:
            freq = self.node_frequency(node)
        entry = (node.pinned, freq << resets, node.last_tick, next(self._seq), node)
        heap = self._heap
        if not heap or entry < heap[0]:
            return node  # fresh, hence valid and current: it would be popped right back
        heapq.heappush(heap, entry)
        self._bound(evictable)
        return self.pop(evictable)

    def pop(self, evictable: Evictable) -> BlockNode | None:
        heap = self._heap
        refreshed = 0
        while heap:
            entry = heapq.heappop(heap)
            if not self._valid(entry, evictable):
                continue
            node = entry[4]
            weight = self._weight(node)
            if weight > entry[1] and refreshed < _MAX_REFRESH:
                refreshed += 1
                heapq.heappush(heap, (entry[0], weight, entry[2], entry[3], node))
                continue
            return node
        return None


class RankedEviction:
    """Unpinned first, lowest capped sighting count, least recent; a newcomer takes a victim's
    slot only if it is at least as frequent, capped alike (the duel)."""

    __slots__ = ("_queues", "max_frequency", "sketch")

    def __init__(
        self, sketch: CountMinSketch, *, max_frequency: int | None, num_tiers: int = 2
    ) -> None:
        self.sketch = sketch
        self.max_frequency = max_frequency
        """Sightings beyond this rank alike, in eviction and in the duel (None: no cap; 1: plain
        recency, under which the duel never refuses anything)."""
        self._queues = [VictimQueue(sketch, max_frequency=max_frequency) for _ in range(num_tiers)]

    def num_queued(self, tier: int) -> int:
        """Entries in `tier`'s queue, stale ones included (for tests and the memory bench)."""
        return len(self._queues[tier])

    def push(self, node: BlockNode, evictable: Evictable) -> None:
        self._queues[node.tier].push(node, evictable)

    def pop(self, tier: int, evictable: Evictable) -> BlockNode | None:
        return self._queues[tier].pop(evictable)

    def push_pop_in(self, tier: int) -> Callable[[BlockNode, Evictable], BlockNode | None]:
        """`push(node)` then `pop(tier)` as one call, `tier`'s own (a chain evicted leaf first:
        the dropped block's parent is usually the next victim; taken once per reclaim, so a
        victim costs no call through this class)."""
        return self._queues[tier].push_pop

    def candidate_weights(self, hashes: Sequence[bytes]) -> list[int]:
        # The index places consecutive blocks of one chain, head first.
        return chain_bound(self.sketch.estimate_many(hashes), self.max_frequency)

    def outranks(self, victim: BlockNode, weight: int) -> bool:
        return self._queues[0].node_frequency(victim) > weight

    def fill(self, tier: int, nodes: Iterable[BlockNode]) -> None:
        self._queues[tier].fill(nodes)
