"""Inferred placement and thrash detection: what the cache does with a prefix, decided from
observed reuse only (R4). No caller declares a policy.

    sightings < admit threshold           -> not stored          (one-shot)
    sightings >= hot threshold and small  -> pinned in T0        (the "system prompt" case)
    otherwise                             -> T1 (T0 without T1)  (the "reused context" case)

While thrashing (blocks dropped per second > 0.9 x blocks offered per second, sustained) the admit
threshold is raised by one: under pressure the scarce resource is the right to occupy space.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Placement", "ThrashDetector", "admit_threshold", "place"]


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
