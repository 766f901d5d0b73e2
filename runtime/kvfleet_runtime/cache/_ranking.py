"""Victim order of one tier: which evictable block goes first. The policy half of eviction,
apart from the index (which knows blocks, chains, refs and tiers and decides what is evictable).

In the manner of vLLM's free-block queue and SGLang's `evict_policy.py`: the index pushes a block
whenever it may have become evictable (released, touched, its last child gone) and pops the first
valid one when it needs room; the queue never decides evictability itself, it asks the `valid`
predicate it is given. The order is (unpinned first, lowest capped sighting count, least
recent, oldest push); a cap of 1 makes it plain LRU. The cap is a constructor argument: another
ranking is another queue (`BlockIndex.set_ranking` rebuilds both tiers').

Lazy: a block pushed twice has two entries; an entry is stale once its block was touched again
(tick), pinned or unpinned since, or is no longer evictable. A popped entry whose block's count
grew since the push is re-ranked (bounded, so one pop stays cheap).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvfleet_runtime.cache._sketch import CountMinSketch

if TYPE_CHECKING:  # the index imports this module: the node type is only needed for checking
    from kvfleet_runtime.cache._index import BlockNode

__all__ = ["VictimQueue"]

_Entry = tuple[bool, int, int, int, "BlockNode"]
"""(pinned, aged frequency, last tick, seq, node); smallest goes first."""

_MAX_REFRESH = 32
"""Victim candidates re-ranked per pop before the current best is taken regardless."""


class VictimQueue:
    def __init__(self, sketch: CountMinSketch, *, max_frequency: int | None) -> None:
        if max_frequency is not None and max_frequency < 1:
            raise ValueError(f"max_frequency must be >= 1 or None, got {max_frequency}")
        self.sketch = sketch
        self.max_frequency = max_frequency
        """Sightings beyond this rank alike, in eviction and in the duel (None: no cap)."""
        self._heap: list[_Entry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def frequency(self, block_hash: bytes) -> int:
        """The sketch's estimate, capped at `max_frequency`."""
        freq = self.sketch.estimate(block_hash)
        cap = self.max_frequency
        return freq if cap is None or freq <= cap else cap

    def frequencies(self, hashes: Sequence[bytes]) -> list[int]:
        freqs = self.sketch.estimate_many(hashes)
        cap = self.max_frequency
        return freqs if cap is None else [min(f, cap) for f in freqs]

    def _weight(self, node: BlockNode) -> int:
        """Frequency scaled by 2^(sketch resets so far). Every reset halves all counters, so
        ordering by f * 2^resets_at_push ranks entries pushed in different epochs exactly as
        their aged frequencies would, without ever re-keying the heap."""
        return self.frequency(node.block_hash) << self.sketch.num_resets

    def _entry(self, node: BlockNode) -> _Entry:
        return (node.pinned, self._weight(node), node.last_tick, next(self._seq), node)

    def push(self, node: BlockNode) -> None:
        """Queue an evictable block (the caller has checked it is)."""
        heapq.heappush(self._heap, self._entry(node))

    def fill(self, nodes: Iterable[BlockNode]) -> None:
        """Replace the queue by these evictable blocks, ranked now."""
        heap = [self._entry(n) for n in nodes]
        heapq.heapify(heap)
        self._heap = heap

    def compact(self, evictable: Callable[[BlockNode], bool]) -> None:
        self._heap = [e for e in self._heap if self._valid(e, evictable)]
        heapq.heapify(self._heap)

    @staticmethod
    def _valid(entry: _Entry, evictable: Callable[[BlockNode], bool]) -> bool:
        pinned, _, tick, _, node = entry
        return node.last_tick == tick and node.pinned == pinned and evictable(node)

    def pop(self, evictable: Callable[[BlockNode], bool]) -> BlockNode | None:
        """The first evictable block in ranking order, taken out of the queue (None: none)."""
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
