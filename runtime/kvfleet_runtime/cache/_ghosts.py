"""The ghost rankings: each candidate eviction ranking replayed over sampled offers in a ghost
of the cache's size (`GhostRanking`), and the one whose ghost hits most handed to the index
(`AdaptiveRanking`). `Admission` (`_admission.py`) feeds them every offer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat

from kvfleet_runtime.cache._eviction import RankedEviction
from kvfleet_runtime.cache._reuse import REUSE_RANKING, GhostReuse
from kvfleet_runtime.cache._sketch import CountMinSketch

__all__ = ["AdaptiveRanking", "GhostRanking", "ghost_rankings", "sample_chain"]


def sample_chain(
    hashes: Sequence[bytes], counts: Sequence[int], sample: int
) -> tuple[Sequence[bytes], Sequence[int]]:
    """The blocks of a chain a ghost sampling 1 hash in `sample` keeps (low bits of a digest
    are uniform), with their counts, in chain order."""
    if len(hashes) != len(counts):
        raise ValueError(f"{len(hashes)} hashes but {len(counts)} counts")
    if sample == 1:
        return hashes, counts
    mask = sample - 1
    keep = [not h[-1] & mask for h in hashes]
    return list(compress(hashes, keep)), list(compress(counts, keep))


_MAX_CLASS = 255
"""Sketch counters saturate at 255: an uncapped ranking has at most this many classes."""

_class_of = (0xFF).__and__
"""A ghost entry's class (`stamp << 8 | class`; -1, an absent block, gives 255: no class)."""

_QUEUE_SLACK = 1024
"""Stale touches a ghost may queue beyond as many as it holds blocks before it compacts."""


class GhostRanking:
    """What one eviction ranking would hold at this cache's capacity: a flat directory of block
    hashes only (no data, no tree), replayed on the same stores as the cache.

    The ranking is "lowest capped sighting class first, least recent within a class": a cap of 1
    is plain LRU (vLLM's free queue), higher caps let reuse count, None ranks by the raw count.
    Every block offered is admitted (the ghost measures eviction order, not admission), and a
    sampled ghost (SHARDS-style spatial sampling: it keeps only blocks whose hash falls in
    1/`sample` of the hash space, at 1/`sample` of the capacity) costs that fraction of the memory
    and measures about the same hit rate.

    Layout, for the request path's sake (a ghost takes a chain's worth of blocks and evicts as
    many at every miss): each held block has one int, its last touch's stamp and class (`stamp
    << 8 | class`); each class is a queue of its touches (hash and that int, two lists read
    from a head index) in touch order, where a touch that a later one superseded is stale and
    skipped when it reaches the front. A chain is queued and its victims dequeued by
    whole-chain calls into C (one probe a block each way); an ordered dict per class (what this
    replaced) cost a linked node per block and a Python step per victim, most of an evicting
    miss's ghost replay."""

    __slots__ = (
        "_entries",
        "_heads",
        "_limit",
        "_live",
        "_low",
        "_queued",
        "_queues",
        "_stamp",
        "capacity_blocks",
        "max_frequency",
        "sample",
    )

    def __init__(
        self, capacity_blocks: int, max_frequency: int | None, *, sample: int = 1
    ) -> None:
        if capacity_blocks < 1 or sample < 1 or sample & (sample - 1):
            raise ValueError(
                f"need capacity_blocks >= 1 and sample a power of two, got {capacity_blocks} "
                f"and {sample}"
            )
        if max_frequency is not None and not 1 <= max_frequency <= _MAX_CLASS:
            raise ValueError(
                f"max_frequency must be in [1, {_MAX_CLASS}] or None, got {max_frequency}"
            )
        self.capacity_blocks = capacity_blocks
        self.max_frequency = max_frequency
        self.sample = sample
        num_classes = _MAX_CLASS if max_frequency is None else max_frequency
        self._entries: dict[bytes, int] = {}
        """Each held block's last touch: `stamp << 8 | class`."""
        self._queues: list[tuple[list[bytes], list[int]]] = [([], []) for _ in range(num_classes)]
        """Per class, the hashes and entries of its touches, oldest first, from `_heads[class]`
        on (what is before it was dequeued); a touch is live while it is its block's entry."""
        self._heads = [0] * num_classes
        self._live = [0] * num_classes
        """Blocks held per class."""
        self._queued = 0
        """Touches queued over all classes, stale ones included."""
        self._stamp = 0
        self._low = 0
        """Every class below this one is empty: eviction starts its scan here, not at class 0
        (the raw-count ghost has 255 classes, most of them empty)."""
        self._limit = max(1, capacity_blocks // sample)
        """Blocks the ghost holds: the capacity's share of the sampled hash space."""

    @property
    def label(self) -> str:
        """The ranking's name in stats: "recency", "count<=N" or "count"."""
        cap = self.max_frequency
        if cap is None:
            return "count"
        return "recency" if cap == 1 else f"count<={cap}"

    def eviction(self, sketch: CountMinSketch) -> RankedEviction:
        """The index's eviction policy for this ranking."""
        return RankedEviction(sketch, max_frequency=self.max_frequency)

    def sampled(self, block_hash: bytes) -> bool:
        # Low bits of a digest are uniform; sample 1 keeps every block.
        return block_hash[-1] & (self.sample - 1) == 0

    def match(self, hashes: Sequence[bytes]) -> int:
        """Blocks of the leading run this ranking would hit, counting sampled blocks only,
        scaled back to the whole hash space."""
        entries = self._entries
        hit = 0
        for h in hashes:
            if h[-1] & (self.sample - 1):
                continue
            if h not in entries:
                break
            hit += 1
        return hit * self.sample

    def offer(self, hashes: Sequence[bytes], counts: Sequence[int]) -> None:
        """One sighting of a chain (with each block's count after it): tail first, so the
        chain's head is the most recent, as the index touches it."""
        self.replay(*sample_chain(hashes, counts, self.sample))

    def _class(self, count: int) -> int:
        top = len(self._queues)
        return (count if count < top else top) - 1 if count > 1 else 0

    def replay(self, hashes: Sequence[bytes], counts: Sequence[int]) -> int:
        """`match` then `offer` in one pass, over the chain's sampled blocks only (with their
        counts, head first; every ghost of a cache samples alike, so `AdaptiveRanking` filters
        once for all, `sample_chain`): returns what `match` would have. The lookups of the
        offer see the ghost as it was before it (a chain's hashes are distinct and nothing
        leaves before the end), so the leading run they find present is the match.

        Two shapes are most of the offers and take no Python step per block: a chain the ghost
        holds none of (every miss), and one it holds all of in the class it stays in (a
        repeated hit); the rest take the general walk, with the same result."""
        entries = self._entries
        n = len(hashes)
        if not n:
            return 0
        k = self._class(min(counts))
        if k != self._class(max(counts)):  # classes are monotone in the count
            first_absent = self._walk(hashes, counts)
        elif entries.keys().isdisjoint(hashes):
            before = len(entries)
            self._touch(hashes, k)
            added = len(entries) - before
            self._live[k] += added
            # Every block new to the ghost. A chain's hashes are distinct (each commits to its
            # prefix); were one repeated, the walk would find its head-side copy present.
            first_absent = 0 if added == n else min({h: i for i, h in enumerate(hashes)}.values())
        elif set(map(_class_of, map(entries.get, hashes, repeat(-1)))) == {k}:
            first_absent = n  # every block held, in the class it stays in
            self._touch(hashes, k)
        else:
            first_absent = self._walk(hashes, counts)
        self._evict(len(entries) - self._limit)
        if self._queued > 2 * len(entries) + _QUEUE_SLACK:
            self._compact()
        return first_absent * self.sample

    def _touch(self, hashes: Sequence[bytes], k: int) -> None:
        """Touch every block of the chain in class `k`, tail first (the head is the most
        recent): their entries, queued at the class's end."""
        n = len(hashes)
        stamp = self._stamp
        self._stamp = stamp + n
        tail_first = hashes[::-1]
        # One int object per touch, held by both the directory and the queue.
        stamps = list(range(stamp << 8 | k, (stamp + n) << 8 | k, 1 << 8))
        self._entries.update(zip(tail_first, stamps, strict=True))
        queue_hashes, queue_entries = self._queues[k]
        queue_hashes.extend(tail_first)
        queue_entries.extend(stamps)
        self._queued += n
        self._low = min(self._low, k)

    def _walk(self, hashes: Sequence[bytes], counts: Sequence[int]) -> int:
        """`replay`'s general case, a block at a time (tail first); returns the first absent
        block's position."""
        entries, queues, live = self._entries, self._queues, self._live
        top = len(queues)
        low = self._low
        stamp = self._stamp
        first_absent = len(hashes)
        for i in range(len(hashes) - 1, -1, -1):
            h, count = hashes[i], counts[i]
            k = (count if count < top else top) - 1 if count > 1 else 0
            old = entries.get(h)
            if old is None:
                first_absent = i
                live[k] += 1
            elif old & 0xFF != k:
                live[old & 0xFF] -= 1
                live[k] += 1
            entry = stamp << 8 | k
            stamp += 1
            entries[h] = entry
            queue_hashes, queue_entries = queues[k]
            queue_hashes.append(h)
            queue_entries.append(entry)
            low = min(low, k)
        self._queued += len(hashes)
        self._stamp = stamp
        self._low = low
        return first_absent

    def _evict(self, excess: int) -> None:
        """Drop `excess` blocks: the lowest class's least recent first."""
        entries, queues, heads, live = self._entries, self._queues, self._heads, self._live
        low = self._low
        while excess > 0:
            while not live[low]:
                low += 1
            queue_hashes, queue_entries = queues[low]
            take = min(excess, live[low])
            head = heads[low]
            # The class's `take` oldest touches. When none is stale (superseded by a later
            # touch) they are its `take` least recent blocks: one pop each, and all go.
            hashes = queue_hashes[head : head + take]
            stamps = queue_entries[head : head + take]
            heads[low] = head = head + take
            self._queued -= take
            popped = list(map(entries.pop, hashes, repeat(None)))
            if popped == stamps:
                gone = take
            else:
                # Put back what the pops took (a repeated hash: its first pop took the entry),
                # then one touch at a time.
                for h, entry in zip(hashes, popped, strict=True):
                    if entry is not None:
                        entries[h] = entry
                gone = 0
                for h, entry in zip(hashes, stamps, strict=True):
                    if entries.get(h) == entry:
                        del entries[h]
                        gone += 1
            live[low] -= gone
            excess -= gone
            if head > _QUEUE_SLACK and 2 * head > len(queue_hashes):
                del queue_hashes[:head], queue_entries[:head]
                heads[low] = 0
        self._low = low

    def _compact(self) -> None:
        """Drop the stale touches; the live ones keep their order. Runs once the queues hold
        twice the blocks (and some), so each touch pays for its own removal about once."""
        entries = self._entries
        for k, (queue_hashes, queue_entries) in enumerate(self._queues):
            head = self._heads[k]
            if len(queue_hashes) - head == self._live[k]:
                continue
            kept = [(h, e) for h, e in zip(queue_hashes[head:], queue_entries[head:], strict=True)
                    if entries.get(h) == e]
            self._queues[k] = ([h for h, _ in kept], [e for _, e in kept])
            self._heads[k] = 0
        self._queued = len(entries)

    def __len__(self) -> int:
        return len(self._entries)


Ghost = GhostRanking | GhostReuse


def ghost_rankings(
    capacity_blocks: int, rankings: Sequence[int | str | None], *, sample: int = 1
) -> list[Ghost]:
    """One ghost per entry of `CacheTuning.eviction_rankings`: a sighting cap (`GhostRanking`)
    or `REUSE_RANKING` (the reuse-time prediction, `GhostReuse`)."""
    ghosts: list[Ghost] = []
    for ranking in rankings:
        if ranking == REUSE_RANKING:
            ghosts.append(GhostReuse(capacity_blocks, sample=sample))
        elif ranking is None or isinstance(ranking, int):
            ghosts.append(GhostRanking(capacity_blocks, ranking, sample=sample))
        else:
            raise ValueError(
                f"an eviction ranking is a sighting cap, None or {REUSE_RANKING!r}, got {ranking!r}"
            )
    return ghosts


@dataclass(slots=True)
class AdaptiveRanking:
    """Which eviction ranking the cache uses, chosen from observed behaviour (R4): one ghost per
    candidate ranking replays every store, and the cache follows the ghost that would have hit
    the most tokens lately (scores decay by `decay` per store). It switches only when another
    ghost leads the current one by `margin` (hysteresis: a switch re-ranks the index).

    Why: no single ranking is right at every pressure. Where space is scarce, counting reuse
    keeps the prefixes that come back (an uncapped ranking hits 2.7x LRU's tokens at 1% of the
    system-prompt workload); where it is not, the live conversation is what comes back next and
    recency wins (plain LRU beats a capped count by 10% at 30% of the agent loops)."""

    ghosts: Sequence[Ghost]
    decay: float
    margin: float
    current: int = 0
    """Index into `ghosts` of the ranking the cache uses now (starts with the first: LRU)."""
    scores: list[float] = field(default_factory=list)
    num_switches: int = 0
    num_ghost_hit_blocks: int = 0
    """Blocks the current ranking's ghost matched beyond what the cache itself held: evicted or
    refused blocks that came back (ARC's ghost hits)."""
    _sample: int = field(default=1, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ghosts:
            raise ValueError("AdaptiveRanking needs at least one ghost ranking")
        if len({g.sample for g in self.ghosts}) != 1:
            raise ValueError("AdaptiveRanking's ghosts must sample alike (one filter for all)")
        self._sample = self.ghosts[0].sample
        if not 0.0 < self.decay < 1.0 or self.margin < 0.0:
            raise ValueError(f"need 0 < decay < 1 and margin >= 0, got {self.decay}, {self.margin}")
        self.scores = [0.0] * len(self.ghosts)

    @property
    def max_frequency(self) -> int | None:
        """The eviction cap of the ranking in use (1: plain recency; None: uncapped, the raw count
        or the reuse-time prediction)."""
        return self.ghosts[self.current].max_frequency

    @property
    def label(self) -> str:
        """The ranking in use, for stats: "recency", "count<=N", "count" or "reuse"."""
        return self.ghosts[self.current].label

    @property
    def strict(self) -> bool:
        """Whether the ranking in use counts reuse (frequency) rather than recency alone: only
        then does thrash raise the admission threshold and arm the duel."""
        cap = self.max_frequency
        return cap is None or cap > 1

    def observe(self, hashes: Sequence[bytes], counts: Sequence[int], resident_blocks: int) -> bool:
        """Score every ghost on this chain, then replay it into them; True when the ranking in
        use changed."""
        decay = self.decay
        sampled_hashes, sampled_counts = sample_chain(hashes, counts, self._sample)
        scores = self.scores
        for i, ghost in enumerate(self.ghosts):
            hit = ghost.replay(sampled_hashes, sampled_counts)
            if i == self.current and hit > resident_blocks:
                self.num_ghost_hit_blocks += hit - resident_blocks
            scores[i] = scores[i] * decay + hit
        best = max(range(len(self.ghosts)), key=self.scores.__getitem__)
        if best != self.current and self.scores[best] > (1.0 + self.margin) * self.scores[
            self.current
        ]:
            self.current = best
            self.num_switches += 1
            return True
        return False
