"""When a timer tick should act on an object: the requeue delay the planner asked for.

kopf timers fire on a fixed interval, but the rollout planner knows better when to look again (a
gate's `checkIntervalSeconds`, the rest of a hold or a window, never for a finished rollout). So
the timer fires at a short resolution and each tick asks `Schedule.is_due` first: a tick that is
not due costs a dict lookup, no API call. `run_scheduled` runs one reconcile and records its
answer:

- a delay in seconds: due again that long from now;
- None: only on change (the change handlers run whatever the schedule says, and re-arm it);
- `kopf.PermanentError` (an object the operator cannot act on, its condition written): stopped
  until the object changes, so the error is logged once, not once per tick;
- `kopf.TemporaryError`: left due, kopf itself waits the error's delay before the next tick.

An object the schedule has never seen is not due: kopf runs a change handler (resume at start,
create, update) for every object before anything else, and that run arms the schedule. So a timer
that fires first does not evaluate an object twice (once for the tick, once for its creation).

Pure bookkeeping with an injected clock: no sleeping, no threads of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

import kopf

__all__ = ["Schedule", "run_scheduled"]


class Schedule:
    """Next due time per object (monotonic seconds; None: not until the object changes)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._guard = threading.Lock()
        self._due_s: dict[Hashable, float | None] = {}

    def is_due(self, key: Hashable) -> bool:
        """An object never seen (a tick before its first change handler) is not due."""
        with self._guard:
            due_s = self._due_s.get(key)
        return due_s is not None and self._clock() >= due_s

    def after(self, key: Hashable, delay_s: float | None) -> None:
        """Due `delay_s` from now; None: not until the next change."""
        if delay_s is not None and not delay_s >= 0:
            raise ValueError(f"a requeue delay must be >= 0 seconds, got {delay_s!r}")
        with self._guard:
            self._due_s[key] = None if delay_s is None else self._clock() + delay_s

    def forget(self, key: Hashable) -> None:
        with self._guard:
            self._due_s.pop(key, None)

    def __len__(self) -> int:
        with self._guard:
            return len(self._due_s)


def run_scheduled(
    schedule: Schedule, key: Hashable, reconcile: Callable[[], float | None]
) -> float | None:
    """Run `reconcile` and arm the schedule from its outcome (see the module docstring)."""
    try:
        delay_s = reconcile()
    except kopf.PermanentError:
        schedule.after(key, None)
        raise
    schedule.after(key, delay_s)
    return delay_s
