"""A medium shared by concurrent fetches: each of n fetches in progress gets 1/n of the
bandwidth (processor sharing), which is how R6's 7 GB/s / 8 fetches = 0.9 GB/s arises.

Implemented with a virtual clock of bytes served per fetch: a fetch of b bytes that starts when
that clock reads v finishes when it reads v + b, so a join or leave costs O(log n).
"""

from __future__ import annotations

import heapq

# Bytes of slack when comparing float finish marks (well under one byte of a ~GB fetch).
_EPS_BYTES = 1e-3


class SharedLink:
    __slots__ = ("_heap", "_last_s", "_served", "bandwidth_bytes_per_s", "epoch")

    def __init__(self, bandwidth_bytes_per_s: float) -> None:
        assert bandwidth_bytes_per_s > 0
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._served = 0.0
        self._last_s = 0.0
        self._heap: list[tuple[float, int]] = []
        self.epoch = 0
        """Bumped whenever the next completion time changes; older completion events are stale."""

    @property
    def num_active(self) -> int:
        return len(self._heap)

    def _advance(self, now_s: float) -> None:
        if self._heap:
            self._served += (now_s - self._last_s) * self.bandwidth_bytes_per_s / len(self._heap)
        self._last_s = now_s

    def start(self, now_s: float, fetch_id: int, num_bytes: float) -> None:
        self._advance(now_s)
        heapq.heappush(self._heap, (self._served + num_bytes, fetch_id))
        self.epoch += 1

    def next_done_s(self) -> float | None:
        if not self._heap:
            return None
        remaining = max(0.0, self._heap[0][0] - self._served)
        return self._last_s + remaining * len(self._heap) / self.bandwidth_bytes_per_s

    def finish(self, now_s: float) -> list[int]:
        """The fetches complete at `now_s`, the time `next_done_s` gave for the current epoch.

        The head is due by construction; it is popped even when float rounding left its mark a
        hair above the clock, which would otherwise reschedule it at the same instant forever.
        """
        self._advance(now_s)
        mark, fetch_id = heapq.heappop(self._heap)
        self._served = max(self._served, mark)
        done = [fetch_id]
        while self._heap and self._heap[0][0] <= self._served + _EPS_BYTES:
            done.append(heapq.heappop(self._heap)[1])
        if not self._heap:
            self._served = 0.0  # keep the marks small, hence exact
        self.epoch += 1
        return done
