"""A running replica's config reload: the live fields applied, the rest reported as needing a
restart (`apply_config`), and the file watched (`watch_config`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from kvfleet_runtime.config.watch import ConfigFileWatcher
from kvfleet_runtime.server._config import (
    ReplicaConfig,
    load_config,
    restart_fields,
)
from kvfleet_runtime.server._state import Replica

log = logging.getLogger(__name__)


def apply_config(replica: Replica, new: ReplicaConfig) -> list[str]:
    """Apply the live fields of `new`; returns the changed fields that need a restart. May copy
    (T0 off drains it): run it off the event loop."""
    pending = restart_fields(replica.boot_config or replica.config, new)
    e = new.engine
    replica.engine.config = dataclasses.replace(
        replica.engine.config, max_batch_size=e.max_batch_size, max_waiting=e.max_waiting,
        max_tokens_per_step=e.max_tokens_per_step)
    replica.engine.cache = replica.cache if new.cache.enabled else None
    if replica.nvme is not None and new.cache.nvme_mode != replica.config.cache.nvme_mode:
        replica.nvme.set_mode(new.cache.nvme_mode)
    replica.config = new
    replica.sync_t0()
    replica.restart_pending = pending
    return pending


async def watch_config(replica: Replica) -> None:
    """Poll the config file; apply a changed, valid file at the first poll that sees it; keep
    the last good config otherwise (`config.watch`: a half-written file is never applied)."""
    path = replica.config_path
    assert path is not None and replica.reloads is not None
    if replica.config_watcher is None:
        replica.config_watcher = ConfigFileWatcher(path)
    watcher = replica.config_watcher
    while True:
        await asyncio.sleep(replica.config.config_poll_interval_s)
        content = await asyncio.to_thread(watcher.poll)
        replica.config_polls = watcher.num_polls
        if content is None:
            if not watcher.error:
                replica.config_errors.pop("replica", None)
            continue
        try:
            # Off the event loop: a file at the parser's bounds takes a while to refuse.
            new = await asyncio.to_thread(load_config, path, overrides=replica.overrides,
                                          content=content)
        except (ValueError, RecursionError, MemoryError) as exc:
            watcher.reject(content, str(exc))
            replica.reloads.labels("rejected").inc()
            replica.config_errors["replica"] = watcher.error
            log.log(logging.DEBUG if watcher.repeated else logging.ERROR,
                    "config reload rejected, keeping the last good config: %s", watcher.error)
            continue
        pending = await asyncio.to_thread(apply_config, replica, new)
        replica.config_errors.pop("replica", None)
        watcher.accept(content)
        replica.config_applied_at_poll = watcher.applied_at_poll
        replica.reloads.labels("applied").inc()
        log.info("config reloaded from %s%s", path,
                 f"; needs a restart to apply: {', '.join(pending)}" if pending else "")



