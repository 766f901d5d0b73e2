"""Admission and inferred placement: what the cache does with a prefix, decided from observed
reuse only (R4). No caller declares a policy.

`Admission` is the one object the manager asks: it counts sightings (the count-min sketch),
replays every offer into the ghost rankings (`AdaptiveRanking`), watches for thrash
(`ThrashDetector`), says how many leading blocks of a chain are worth storing, and hands out the
`EvictionPolicy` (`_eviction.py`) of the ranking the ghosts chose, for the index to use.

    sightings < admit threshold           -> not stored          (one-shot)
    sightings >= hot threshold and small  -> pinned in T0        (the "system prompt" case)
    otherwise                             -> T1 (T0 without T1)  (the "reused context" case)

While thrashing (blocks dropped per second > 0.9 x blocks offered per second, sustained) the admit
threshold is raised by one: under pressure the scarce resource is the right to occupy space.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat

from kvfleet_runtime.cache._eviction import EvictionPolicy, RankedEviction, chain_bound
from kvfleet_runtime.cache._reuse import REUSE_RANKING, GhostReuse
from kvfleet_runtime.cache._sketch import CountMinSketch

__all__ = [
    "AdaptiveRanking",
    "Admission",
    "Admitted",
    "GhostRanking",
    "Placement",
    "ThrashDetector",
    "admit_threshold",
    "ghost_rankings",
    "place",
]


class Placement(enum.Enum):
    NOT_STORED = "not_stored"
    REUSED = "reused"
    PINNED = "pinned"


def admit_threshold(admit_min_sightings: int, *, thrashing: bool) -> int:
    """Sightings a block needs before it is stored; one more while thrashing."""
    return admit_min_sightings + (1 if thrashing else 0)


def place(
    sightings: int,
    prefix_bytes: int,
    *,
    admit_min_sightings: int,
    hot_min_sightings: int,
    pin_max_bytes: int,
    thrashing: bool,
) -> Placement:
    admit = admit_threshold(admit_min_sightings, thrashing=thrashing)
    if sightings < admit:
        return Placement.NOT_STORED
    if sightings >= max(hot_min_sightings, admit) and prefix_bytes <= pin_max_bytes:
        return Placement.PINNED
    return Placement.REUSED


@dataclass(slots=True)
class ThrashDetector:
    """Counts blocks offered to the cache and blocks dropped from it in fixed windows of the
    caller's clock; thrashing starts after `sustain_s` of consecutive windows above `ratio` and
    stops at the first window at or below half of it (hysteresis, so it does not flap)."""

    ratio: float
    window_s: float
    sustain_s: float
    min_blocks: int
    thrashing: bool = False
    num_episodes: int = 0
    _window_start_s: float | None = None
    _offered: int = 0
    _dropped: int = 0
    _above_since_s: float | None = None

    def record(self, now_s: float, *, offered: int = 0, dropped: int = 0) -> None:
        if self._window_start_s is None:
            self._window_start_s = now_s
        while now_s - self._window_start_s >= self.window_s:
            self._close_window(self._window_start_s + self.window_s)
        self._offered += offered
        self._dropped += dropped

    def _close_window(self, end_s: float) -> None:
        offered, dropped = self._offered, self._dropped
        self._offered = self._dropped = 0
        self._window_start_s = end_s
        if offered < self.min_blocks and dropped < self.min_blocks:
            above = False
            below = True
        else:
            above = dropped > self.ratio * max(offered, 1)
            below = dropped <= 0.5 * self.ratio * offered
        if above:
            if self._above_since_s is None:
                self._above_since_s = end_s - self.window_s
            if not self.thrashing and end_s - self._above_since_s >= self.sustain_s:
                self.thrashing = True
                self.num_episodes += 1
        else:
            self._above_since_s = None
            if self.thrashing and below:
                self.thrashing = False


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


@dataclass(slots=True, frozen=True)
class Admitted:
    """What admission decided for one offered chain."""

    num_blocks: int
    """Leading blocks worth storing, resident ones included (counts only fall along a chain, up
    to sketch noise, so admission stops at the first block below the threshold)."""
    num_first_sightings: int
    """Of the admitted blocks not yet resident, those seen for the first time."""
    num_refused: int
    """Blocks beyond both the admitted and the resident prefix."""
    thrashing: bool
    """Whether admission was tightened for this offer (see `Admission.thrashing`)."""
    ranking_changed: bool
    """The ghosts chose another eviction ranking: the index needs `Admission.eviction()`."""


class Admission:
    """First-sighting admission that tightens under pressure, and the ranking the ghosts choose.

    Two calls per offered chain, with the index's own work between them: `count` (one sighting
    of every block, before the index touches the resident prefix, so that the touch ranks it by
    its new count), then `decide` with the resident prefix's length. The thresholds are
    constructor arguments; what changes with time is observed, never set by a caller."""

    __slots__ = ("admit_min_sightings", "ranking", "sketch", "thrash")

    def __init__(
        self,
        sketch: CountMinSketch,
        ranking: AdaptiveRanking,
        thrash: ThrashDetector,
        *,
        admit_min_sightings: int,
    ) -> None:
        if admit_min_sightings < 1:
            raise ValueError(f"admit_min_sightings must be >= 1, got {admit_min_sightings}")
        self.sketch = sketch
        self.ranking = ranking
        self.thrash = thrash
        self.admit_min_sightings = admit_min_sightings

    @property
    def thrashing(self) -> bool:
        """Under pressure, as far as admission is concerned: the thrash detector fired and the
        ranking in use counts reuse (then one more sighting is needed). Under plain recency (the
        ghosts found that LRU hits the most here) thrash tightens nothing: selectivity is what
        lost, and the duel refuses nothing either (every count is capped to 1)."""
        return self.thrash.thrashing and self.ranking.strict

    def eviction(self) -> EvictionPolicy:
        """A fresh eviction policy for the ranking in use (the index fills it)."""
        return self.ranking.ghosts[self.ranking.current].eviction(self.sketch)

    def count(self, hashes: Sequence[bytes], now_s: float) -> list[int]:
        """One sighting of each block of the chain; returns their counts after it, each bounded
        by its parent's (`chain_bound`)."""
        self.thrash.record(now_s, offered=len(hashes))
        return chain_bound(self.sketch.increment_many(hashes))

    def note_dropped(self, num_blocks: int, now_s: float) -> None:
        self.thrash.record(now_s, dropped=num_blocks)

    def decide(
        self, hashes: Sequence[bytes], counts: Sequence[int], resident_blocks: int
    ) -> Admitted:
        changed = self.ranking.observe(hashes, counts, resident_blocks)
        thrashing = self.thrashing
        admit = admit_threshold(self.admit_min_sightings, thrashing=thrashing)
        if counts and min(counts) >= admit:
            admitted = len(counts)  # the usual case at the default threshold: no walk
        else:
            admitted = 0
            for count in counts:
                if count < admit:
                    break
                admitted += 1
        refused = len(hashes) - max(admitted, resident_blocks) if admitted < len(hashes) else 0
        first = counts[resident_blocks:admitted].count(1)
        return Admitted(admitted, first, refused, thrashing, changed)
