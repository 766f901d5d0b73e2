"""Admission and inferred placement: what the cache does with a prefix, decided from observed
reuse only (R4). No caller declares a policy.

`Admission` is the one object the manager asks: it counts sightings (the count-min sketch),
replays every offer into the ghost rankings (`AdaptiveRanking`, `_ghosts.py`), watches for thrash
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
from dataclasses import dataclass

from kvfleet_runtime.cache._eviction import EvictionPolicy, chain_bound
from kvfleet_runtime.cache._ghosts import AdaptiveRanking
from kvfleet_runtime.cache._sketch import CountMinSketch

__all__ = [
    "Admission",
    "Admitted",
    "Placement",
    "ThrashDetector",
    "admit_threshold",
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
