"""What a running replica holds (`Replica`): its config, model, engine, cache and tiers, and the
state the config watcher and the fleet tier update. The app (`_app.py`), the endpoints
(`server/_completions.py`) and `invalidate_local` (`_tiers.py`) all read it; it imports none of
them. `wire_tiers` is the one place that puts the tiers below the cache behind the engine's
prepare, in their order (T3, then T2)."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from kvfleet_runtime.background import Supervisor
from kvfleet_runtime.cache import LowerTier, PrefixCache
from kvfleet_runtime.config.watch import ConfigFileWatcher
from kvfleet_runtime.engine import Engine
from kvfleet_runtime.model import LoadedModel
from kvfleet_runtime.nvme import NvmeTier
from kvfleet_runtime.server._config import ReplicaConfig
from kvfleet_runtime.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["Replica"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Replica:
    """Everything a running replica holds; the app's handlers read it, the watcher updates it."""

    config: ReplicaConfig
    loaded: LoadedModel
    model_id: str
    engine: Engine
    cache: PrefixCache | None
    registry: CollectorRegistry
    config_path: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    """The model folder's own tokenizer (`load_tokenizer`): prompts, streamed text, stop ids."""
    ready: bool = False
    restart_pending: list[str] = field(default_factory=list)
    boot_config: ReplicaConfig | None = None
    """The config the replica started with; restart-only fields are compared against it, so a
    reload that passes through another value (a half-written file) reports only real drift."""
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    reloads: Counter | None = None
    nvme: NvmeTier | None = None
    """T3, when `cache.nvme_path` and `cache.nvme_capacity_bytes` are set and the path can hold
    it; its mode follows `cache.nvme_mode`, or the fleet config's toggles when there is one."""
    t0_device: bool = True
    """The fleet config's `tiers.t0_device` (True without a fleet config); T0 is on when this and
    `config.cache.t0_enabled` both are (`sync_t0`)."""
    config_polls: int = 0
    """Polls of the config file so far (0 without one)."""
    config_applied_at_poll: int = 0
    """The poll at which the config in force was applied (0: the one it started with)."""
    config_errors: dict[str, str] = field(default_factory=dict)
    """Why the file now on disk is not in force, per file ("replica"; the fleet tier adds
    "fleet"), shown by /readyz; empty once a valid file applies. The last good config serves."""
    peers: LowerTier | None = None
    """T2, set by the fleet tier while it runs (`kvfleet_runtime.fleet.fleet_tier`): asked by the
    engine's prepare after T3 (`wire_tiers`)."""
    config_watcher: ConfigFileWatcher | None = None
    """The config file's watcher, made by the first run of the watch loop and kept across its
    restarts (a restarted loop must not take the file on disk for the config in force)."""
    supervisor: Supervisor = field(init=False)
    """Runs the replica's background loops (config watch, engine, fleet tier): a loop that dies
    is logged and restarted (`kvfleet_runtime.background`)."""
    _t0_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(registry=self.registry)
    """Serializes `sync_t0`: the replica config and the fleet config are applied on different
    worker threads, and the second to run must see both inputs."""

    def wire_tiers(self) -> None:
        """Put the tiers below the cache behind the engine's prepare, in the order the engine
        asks them: T3 (this replica's NVMe, cheaper to read), then T2 (a peer, over the network)
        for what T3 lacks. Called when either appears or goes (build, the fleet tier's start and
        stop); a tier's own mode or toggle (off, shadow) is the tier's to apply."""
        tiers: list[LowerTier] = [t for t in (self.nvme, self.peers) if t is not None]
        self.engine.lower_tiers = tuple(tiers)

    def sync_t0(self) -> None:
        """Turn T0 on or off to match `cache.t0_enabled` and the fleet's `tiers.t0_device` (both
        must say on). Off drains T0 (`PrefixCache.set_t0_enabled`: a copy of every cached T0
        block to T1), so callers on the event loop run this in a worker thread."""
        cache = self.cache
        if cache is None or cache.device_kv is None:
            return
        with self._t0_lock:
            wanted = self.config.cache.t0_enabled and self.t0_device
            if wanted == cache.t0_enabled:
                return
            demoted, removed = cache.set_t0_enabled(wanted)
        if wanted:
            log.info("T0 on: prompts are cached in the engine's KV again")
        else:
            log.info("T0 off: %d blocks demoted to T1, %d dropped", demoted, removed)
