"""The bounded priority store queue (R3): a full queue drops its least valuable write.

Priority = stored prefix length in tokens x sighting count. When full, a newcomer worth at least
the least valuable pending entry replaces it (among equals the oldest goes); a newcomer worth less
is the one dropped. Thread-safe: `push` runs on the request path and `pop` on a drain thread, and
neither waits for a copy (the lock guards a short list, never tensor work).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["StoreQueue"]

P = TypeVar("P")


@dataclass(slots=True, order=True)
class _Entry(Generic[P]):
    priority: int
    seq: int
    payload: P = field(compare=False)


class StoreQueue(Generic[P]):
    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: list[_Entry[P]] = []  # ascending: [0] is the least valuable, oldest first
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, priority: int, payload: P) -> P | None:
        """Queue `payload`; returns the payload dropped to make room (maybe this one), or None."""
        entry = _Entry(priority, next(self._seq), payload)
        with self._lock:
            dropped: P | None = None
            if len(self._entries) >= self.max_entries:
                lowest = self._entries[0]
                if priority < lowest.priority:
                    return payload
                dropped = self._entries.pop(0).payload
            bisect.insort(self._entries, entry)
            return dropped

    def pop(self) -> P | None:
        """The most valuable pending write (the oldest among equals), or None when empty."""
        with self._lock:
            if not self._entries:
                return None
            best = self._entries[-1].priority
            # Among equal priorities the oldest has the lowest seq: the leftmost of the equal run.
            i = bisect.bisect_left(self._entries, _Entry(best, -1, None))
            return self._entries.pop(i).payload

    def remove_if(self, predicate: Callable[[P], bool]) -> list[P]:
        with self._lock:
            removed = [e.payload for e in self._entries if predicate(e.payload)]
            self._entries = [e for e in self._entries if not predicate(e.payload)]
            return removed

    def priorities(self) -> list[int]:
        with self._lock:
            return [e.priority for e in self._entries]
