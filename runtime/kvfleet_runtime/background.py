"""The one way a replica and a router run their background loops: a supervisor that logs and
restarts any that dies.

Before issue 44 each loop was a bare `asyncio.create_task`: the config watcher died on one byte
of a config file (an exception escaped its loop), nothing was logged (the exception sat in a
task nobody awaited), `/readyz` kept saying what it said before, and the loop never ran again.
Now every long-lived loop (the replica's config watcher, the engine's scheduler and cache drain,
the fleet tier's registration and config poll, the hint publisher; the router's load and
config poll, its KV-event subscriptions) is started here:

    supervisor = Supervisor(registry=registry)
    handle = supervisor.start("kvfleet-config-watch", lambda: watch_config(replica))
    ...
    await supervisor.stop()          # or handle.cancel() for one loop

Each loop runs in a task of its own name (what `asyncio.all_tasks()` shows), inside a keeper
task (the handle). When the loop raises, or is cancelled by anyone but its keeper (the kill a
test does), the keeper logs one ERROR line naming the loop and why (the first death of each loop
with its traceback: it is a bug), counts it (`restarts`, `kvfleet_background_restarts_total`),
waits a back-off (doubling from `min_backoff_s` to `max_backoff_s`, reset once a run lasted
`healthy_after_s`) and starts it again. A loop that returns has finished (the engine's scheduler
returns when the engine closes): the handle completes. Cancelling the handle (or `stop`) cancels
the loop and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

_MAX_REASON_CHARS = 200


class Supervisor:
    """Keeps named background loops running; see the module docstring."""

    def __init__(self, *, registry: Any = None, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, healthy_after_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < min_backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < min_backoff_s ({min_backoff_s}) <= max_backoff_s "
                             f"({max_backoff_s})")
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.clock = clock
        self.restarts: dict[str, int] = {}
        """Loop name -> times it died and was started again."""
        self.last_death: dict[str, str] = {}
        """Loop name -> why it last died (one line)."""
        self._keepers: dict[str, asyncio.Task[None]] = {}
        self._counter: Any = None
        if registry is not None:
            from prometheus_client import Counter

            self._counter = Counter(
                "kvfleet_background_restarts",
                "Background loops that died (raised, or were cancelled from outside) and were "
                "started again, by loop.", ["task"], registry=registry)

    def start(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run `run()` as the loop `name` (on the running event loop) until it returns or the
        handle is cancelled, restarting it whenever it dies. Names are unique while running."""
        keeper = self._keepers.get(name)
        if keeper is not None and not keeper.done() and not keeper.cancelling():
            raise ValueError(f"a background loop named {name!r} is already running")
        self.restarts.setdefault(name, 0)
        keeper = asyncio.get_running_loop().create_task(self._keep(name, run),
                                                        name=f"{name}-keeper")
        self._keepers[name] = keeper
        return keeper

    async def stop(self) -> None:
        """Cancel every loop and wait for them."""
        keepers = list(self._keepers.values())
        for keeper in keepers:
            keeper.cancel()
        for keeper in keepers:
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        self._keepers.clear()

    async def _keep(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        backoff_s = self.min_backoff_s
        while True:
            started = self.clock()
            loop_task = asyncio.ensure_future(run())
            loop_task.set_name(name)
            try:
                # `wait` does not cancel the loop when the keeper is cancelled: done below
                await asyncio.wait([loop_task])
            except asyncio.CancelledError:
                loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await loop_task
                raise
            if loop_task.cancelled():
                why, exc = "cancelled from outside its supervisor", None
            else:
                exc = loop_task.exception()
                if exc is None:
                    return  # finished
                why = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            why = why if len(why) <= _MAX_REASON_CHARS else why[: _MAX_REASON_CHARS - 3] + "..."
            if self.clock() - started >= self.healthy_after_s:
                backoff_s = self.min_backoff_s
            first = not self.restarts[name]
            self.restarts[name] += 1
            self.last_death[name] = why
            if self._counter is not None:
                self._counter.labels(name).inc()
            log.error("background loop %s died (%s); restarting it in %.3g s (restart %d)",
                      name, why, backoff_s, self.restarts[name],
                      exc_info=exc if first and exc is not None else None)
            await asyncio.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, self.max_backoff_s)
