"""Attaching the fleet tier to a running replica (`kvfleet replica`).

    settings = FleetSettings.from_env(os.environ, port=cfg.port)   # None: fleet tier off
    if settings is not None:
        attach_fleet(app, replica, settings)

What it adds to the replica's aiohttp app:

- `POST /kv/v1/blocks`: the T2 endpoint (authenticated; see `t2_protocol`), serving from the
  cache; `POST /kv/v1/lease` and `/kv/v1/lease/release`: T2 over NIXL's control routes (the run
  pinned for a lease and read one-sided by the peer, `fleet.t2_nixl`), with this replica's
  NIXL agent when NIXL is installed (else they answer 501 and peers use the HTTP path).
- `GET /fleet/v1/load`: the load report the router polls (`kvfleet_runtime.picker._view`):
  KV occupancy of the engine's working blocks, queue depth and an estimated queue delay, and the
  cache key fields and tokenizer id the router needs to compute the prompt's block hashes.
- `POST /kv/v1/held`: the held probe (same credential as T2): how many leading blocks of a chain
  this replica holds for the caller's tenant, for peers whose hint index is the peer probe.
- A cache listener that publishes "stored" blocks to the hint index and withdraws "removed" ones
  (batched, in the background), and registers this replica's peer URL; a hit listener that keeps
  the hints of blocks in use alive (re-published at most every refresh period).
- T2 behind the engine's prepare (`fleet.peer_tier.PeerTier`, a `LowerTier`, `replica.peers`,
  asked after T3: `Replica.wire_tiers`): for the blocks of a prompt's chain no tier above
  supplies, the hint index's best peer; its run lands straight in the blocks the engine
  allocated. Any failure: nothing lands, the engine prefills. What this replica holds (for its
  T2 source and the held probe) is read from the cache's own index (`PrefixCache.num_held`).
- The fleet config file (if any) is watched (`config.watch`: applied at the first poll that sees
  it, never half-written) and every tier toggle applies live, within that poll, with no restart:
  `tiers.t0_device` off stops caching in the engine's KV and drains T0 into T1
  (`Replica.sync_t0`, `PrefixCache.set_t0_enabled`; on only where `cache.t0_enabled` is too);
  `tiers.t2_peer` turns both fetching from peers and serving them (T2 endpoint and held probe)
  on and off; `tiers.t1_host` off drains T1 (`PrefixCache.set_t1_enabled`); `tiers.nvme` /
  `tiers.nvme_shadow` set the T3 mode (on / shadow / off). The load report's `tiers` says what
  is in force, with the config's generation and the poll that applied it. The config's replica
  list resolves peer names to URLs before the index's own registry. The load report carries T3's
  measured read bandwidth for the operator (`nvme`).

The hint index (`hint_index_for`): Redis Cluster when `KVFLEET_REDIS_CLUSTER_URLS` is set, Redis
when `KVFLEET_REDIS_URL` is; else, when a fleet config is configured, the peer probe
(`fleet.probe`: each lookup asks the config's other replicas directly, so replicas on one machine
share blocks over T2 with nothing installed); else the embedded in-process index (which only sees
this process: no T2 between processes).

Environment (all optional; none of the first four set -> no fleet tier):

    KVFLEET_FLEET_NAME      this replica's name in the fleet (default $POD_NAME, else hostname)
    KVFLEET_REDIS_URL       hint index; unset -> the peer probe (with a fleet config) or the
                            embedded in-process index
    KVFLEET_REDIS_CLUSTER_URLS  hint index on a Redis Cluster: seed node URLs, comma-separated
                            (wins over KVFLEET_REDIS_URL)
    KVFLEET_PEER_SECRET     shared T2 secret, or KVFLEET_PEER_SECRET_FILE (default
                            /etc/kvfleet/peer/token when present); none -> T2 refused both ways
    KVFLEET_FLEET_CONFIG    fleet config file (default /etc/kvfleet/fleet/fleet.yaml when present)
    KVFLEET_PEER_URL        URL peers use for this replica (default http://$POD_IP:<port>)
    KVFLEET_HINT_LOOKUP_BUDGET_S   hint lookup budget (default 0.002 with Redis, 0.05 for the
                                   peer probe)
    KVFLEET_PEER_BODY_TIMEOUT_S    deadline of a peer's request body (default 10)
    KVFLEET_T2_NIXL         "0": no NIXL agent (T2 over HTTP only, both ways) even where NIXL
                            is installed (default "1")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import aiohttp
from aiohttp import web

from kvfleet_runtime.auth import hint_key as derive_hint_key
from kvfleet_runtime.auth import read_router_secret
from kvfleet_runtime.cache import BlockEvent, BlockHash, CacheKey
from kvfleet_runtime.config.fleet import FleetConfig, TierToggles, next_fleet_config
from kvfleet_runtime.config.watch import ConfigFileWatcher
from kvfleet_runtime.fleet._metrics import FleetTierCollector
from kvfleet_runtime.fleet.hint_index import (
    EmbeddedHintIndex,
    HintIndex,
    RedisClusterHintIndex,
    RedisHintIndex,
    split_seed_urls,
)
from kvfleet_runtime.fleet.peer_tier import PeerTier
from kvfleet_runtime.fleet.probe import DEFAULT_PROBE_BUDGET_S, PeerProbeHintIndex
from kvfleet_runtime.fleet.publisher import HintPublisher
from kvfleet_runtime.fleet.t2_fetch import FetchStats, PeerFetcher
from kvfleet_runtime.fleet.t2_lease import LEASE_BUDGET_FRACTION, LeaseTable
from kvfleet_runtime.fleet.t2_nixl import NixlAgent
from kvfleet_runtime.fleet.t2_protocol import PeerSecrets
from kvfleet_runtime.fleet.t2_serve import (
    DEFAULT_PEER_BODY_TIMEOUT_S,
    ExportedRun,
    LeasedRun,
    lease_routes,
    peer_routes,
)
from kvfleet_runtime.fleet.t2_source import CacheBlockSource
from kvfleet_runtime.nvme import mode_for
from kvfleet_runtime.wire import BLOCK_SIZE, LOAD_PATH, LoadReport

if TYPE_CHECKING:
    from kvfleet_runtime.server import Replica

__all__ = ["FleetSettings", "FleetTier", "attach_fleet"]

log = logging.getLogger(__name__)

DEFAULT_SECRET_FILE = Path("/etc/kvfleet/peer/token")
DEFAULT_FLEET_CONFIG = Path("/etc/kvfleet/fleet/fleet.yaml")
DEFAULT_REDIS_BUDGET_S = 0.002
_ENABLING = (
    "KVFLEET_FLEET_NAME",
    "KVFLEET_REDIS_URL",
    "KVFLEET_REDIS_CLUSTER_URLS",
    "KVFLEET_PEER_SECRET",
    "KVFLEET_PEER_SECRET_FILE",
)


@dataclass(slots=True)
class FleetSettings:
    name: str
    peer_url: str
    secret: bytes | None = None
    redis_url: str | None = None
    redis_cluster_urls: tuple[str, ...] = ()
    """Seed nodes of a Redis Cluster holding the hint index (wins over `redis_url`)."""
    fleet_config: Path | None = None
    fetch_timeout_s: float = 2.0
    max_concurrent_fetches: int = 4
    min_fetch_blocks: int = 2
    """Runs shorter than this are recomputed: a round trip costs more than a few blocks."""
    max_fetch_blocks: int = 4096
    """At most this many blocks are fetched for one request (one transfer)."""
    config_poll_s: float = 2.0
    register_every_s: float = 60.0
    hint_lookup_budget_s: float | None = None
    """A hint lookup slower than this answers "nobody" (the request recomputes). None: the
    index's default (2 ms for Redis, `probe.DEFAULT_PROBE_BUDGET_S` for the peer probe)."""
    secrets: PeerSecrets | None = None
    """Every accepted peer secret (`secret` is the first, the one that signs); re-read from
    the secret file at every config poll, so a rotation needs no restart."""
    peer_body_timeout_s: float = DEFAULT_PEER_BODY_TIMEOUT_S
    """A peer's request body (`/kv/v1/blocks`, `/kv/v1/held`) must arrive within this (408)."""
    hint_key: bytes | None = None
    """Names the blocks in a Redis hint index by their keyed digest (`auth.hint_key`, derived
    from the router secret, which routers and replicas hold); None: by hash."""
    nixl: bool = True
    """T2 over NIXL where NIXL is installed (`KVFLEET_T2_NIXL`, "0" turns it off)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, port: int) -> FleetSettings | None:
        secret_file = environ.get("KVFLEET_PEER_SECRET_FILE")
        if not any(environ.get(name) for name in _ENABLING) and not DEFAULT_SECRET_FILE.exists():
            return None
        raw = environ.get("KVFLEET_PEER_SECRET", "").encode()
        secrets = PeerSecrets(PeerSecrets.parse(raw)) if PeerSecrets.parse(raw) else None
        path = Path(secret_file) if secret_file else DEFAULT_SECRET_FILE
        if secrets is None and path.exists():
            try:
                secrets = PeerSecrets.from_file(path)
            except OSError as exc:
                raise ValueError(f"cannot read the peer secret {path}: {exc}") from exc
        elif secrets is None and secret_file:
            raise ValueError(f"KVFLEET_PEER_SECRET_FILE {secret_file} does not exist")
        secret = secrets.signing if secrets is not None else None
        name = environ.get("KVFLEET_FLEET_NAME") or environ.get("POD_NAME") or socket.gethostname()
        host = environ.get("POD_IP") or socket.gethostname()
        config = environ.get("KVFLEET_FLEET_CONFIG")
        config_path = (
            Path(config)
            if config
            else (DEFAULT_FLEET_CONFIG if DEFAULT_FLEET_CONFIG.exists() else None)
        )
        budget = environ.get("KVFLEET_HINT_LOOKUP_BUDGET_S")
        try:
            budget_s = float(budget) if budget else None
        except ValueError:
            raise ValueError(
                f"KVFLEET_HINT_LOOKUP_BUDGET_S must be seconds, got {budget!r}"
            ) from None
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"KVFLEET_HINT_LOOKUP_BUDGET_S must be > 0, got {budget!r}")
        body_timeout = environ.get("KVFLEET_PEER_BODY_TIMEOUT_S")
        try:
            body_timeout_s = float(body_timeout) if body_timeout else DEFAULT_PEER_BODY_TIMEOUT_S
        except ValueError:
            raise ValueError(
                f"KVFLEET_PEER_BODY_TIMEOUT_S must be seconds, got {body_timeout!r}") from None
        if not 0 < body_timeout_s <= 600:
            raise ValueError(f"KVFLEET_PEER_BODY_TIMEOUT_S must be in (0, 600], got "
                             f"{body_timeout!r}")
        return cls(
            name=name,
            peer_url=environ.get("KVFLEET_PEER_URL") or f"http://{host}:{port}",
            secret=secret,
            secrets=secrets,
            redis_url=environ.get("KVFLEET_REDIS_URL") or None,
            redis_cluster_urls=split_seed_urls(environ.get("KVFLEET_REDIS_CLUSTER_URLS", "")),
            fleet_config=config_path,
            hint_lookup_budget_s=budget_s,
            peer_body_timeout_s=body_timeout_s,
            hint_key=derive_hint_key(read_router_secret(environ)),
            nixl=_nixl_setting(environ.get("KVFLEET_T2_NIXL", "1")),
        )


def _nixl_setting(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f'KVFLEET_T2_NIXL must be "0" or "1", got {raw!r}')
    return raw == "1"


def hint_index_for(
    settings: FleetSettings, peers: Callable[[], Mapping[str, str]] | None = None
) -> HintIndex:
    """Redis when a URL is configured; else the peer probe when the replica knows its peers (a
    fleet config is configured and `peers` reads its replica list: {name: URL}); else the
    embedded in-process index. The configured lookup budget reaches Redis and the probe."""
    budget = settings.hint_lookup_budget_s
    redis_budget_s = DEFAULT_REDIS_BUDGET_S if budget is None else budget
    if settings.redis_cluster_urls:
        return RedisClusterHintIndex.from_urls(
            settings.redis_cluster_urls, lookup_budget_s=redis_budget_s,
            hint_key=settings.hint_key)
    if settings.redis_url:
        return RedisHintIndex.from_url(settings.redis_url, lookup_budget_s=redis_budget_s,
                                       hint_key=settings.hint_key)
    if peers is not None and settings.fleet_config is not None:
        return PeerProbeHintIndex(
            settings.secret,
            peers,
            settings.name,
            lookup_budget_s=DEFAULT_PROBE_BUDGET_S if budget is None else budget,
        )
    return EmbeddedHintIndex()


def hint_index_kind(index: HintIndex) -> str:
    """The kind of `index`: "redis-cluster", "redis", "peer-probe" or "embedded" (for logs and
    reports)."""
    if isinstance(index, RedisClusterHintIndex):
        return "redis-cluster"
    if isinstance(index, RedisHintIndex):
        return "redis"
    if isinstance(index, PeerProbeHintIndex):
        return "peer-probe"
    return "embedded"


class _GatedSource:
    """The T2 source, answering nothing while `tiers.t2_peer` is off (the endpoint says 404:
    no block held, which a peer treats as a miss)."""

    def __init__(self, source: CacheBlockSource, serving: Callable[[], bool]) -> None:
        self.source = source
        self.serving = serving

    async def export(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> ExportedRun | None:
        if not self.serving():
            return None
        return await self.source.export(key, token_ids, start_block, max_blocks)

    async def lease(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> LeasedRun | None:
        if not self.serving():
            return None
        return await self.source.lease(key, token_ids, start_block, max_blocks)


class FleetTier:
    """The fleet tier of one replica; built by `attach_fleet`, started with the app."""

    def __init__(self, replica: Replica, settings: FleetSettings) -> None:
        assert replica.cache is not None, "the fleet tier needs the replica's prefix cache"
        self.replica = replica
        self.cache = replica.cache
        self.settings = settings
        self.config: FleetConfig | None = None
        self._peer_urls: dict[str, str] = {}
        self.index = hint_index_for(settings, peers=self._peers)
        self.publisher = HintPublisher(self.index, settings.name)
        self.session: aiohttp.ClientSession | None = None
        self.tier: PeerTier | None = None
        self.t2_enabled = True
        """`tiers.t2_peer`: fetch from peers and serve them (both ways at once)."""
        self._watcher: ConfigFileWatcher | None = None
        # T2 over NIXL: one agent for this process, the cache's pools registered once, now.
        self.nixl = NixlAgent.start(settings.name, self.cache.pools()) if settings.nixl else None
        pools = self.cache.pools()
        self.leases = LeaseTable(
            max_blocks=max(1, int(LEASE_BUDGET_FRACTION * sum(
                p.k.shape[1] for p in pools if p is not None))),
            clock=time.monotonic)
        self.cache.add_listener(self._publish)
        self.cache.add_hit_listener(self._refresh)
        replica.registry.register(FleetTierCollector(self._metrics_snapshot))

    def _metrics_snapshot(self) -> tuple[FetchStats | None, TierToggles]:
        stats = self.tier.fetcher.stats if self.tier is not None else None
        return stats, self.config.tiers if self.config is not None else TierToggles()

    def _publish(self, event: BlockEvent) -> None:
        if event.kind == "stored":
            self.publisher.offer_stored(event.block_hashes, tenant=event.key.tenant_id)
        else:
            self.publisher.offer_removed(event.block_hashes, tenant=event.key.tenant_id)

    def _peers(self) -> dict[str, str]:
        """The fleet config's ready replicas other than this one: {name: T2 URL}."""
        return self._peer_urls

    def _resolve(self, host: str) -> str | None:
        if self.config is None:
            return None
        return next((r.peer_url or r.url for r in self.config.replicas if r.name == host), None)

    def _refresh(self, key: CacheKey, blocks: tuple[BlockHash, ...]) -> None:
        """Keep the hints of a local hit's blocks alive while T2 is on (the publisher sends a
        hash again only after its refresh period)."""
        if self.tier is not None and self.t2_enabled:
            self.publisher.offer_stored(blocks, refresh=True, tenant=key.tenant_id)

    def load_report(self) -> dict[str, Any]:
        engine = self.replica.engine
        kv = engine.kv
        total = kv.num_blocks
        fields = engine.key_fields
        waiting, running = engine.num_waiting, engine.num_running
        report = LoadReport(
            ready=self.replica.ready,
            kv_occupancy=(total - kv.num_free_blocks) / total if total else 0.0,
            kv_capacity_tokens=total * BLOCK_SIZE,
            num_waiting=waiting,
            num_running=running,
            # A crude estimate: the router adds its own in-flight requests on top.
            queue_delay_s=0.0 if waiting == 0 else waiting * 0.05,
            cache_key=(
                fields.model_id,
                fields.weights_digest,
                fields.kv_dtype,
                fields.rope_config_hash,
                fields.attn_impl_id,
            ),
            tokenizer=self.replica.tokenizer.name,
        )
        nvme = self.replica.nvme
        return report.to_dict() | {
            "name": self.settings.name,
            "t2": self.t2_report(),
            "tiers": self.tiers_report(),
            "nvme": nvme.report() if nvme is not None else None,
        }

    def tiers_report(self) -> dict[str, Any]:
        """The toggles in force on this replica (what the operator published, as applied)."""
        cache = self.cache
        nvme = self.replica.nvme
        watcher = self._watcher
        return {
            "t0_device": cache.t0_enabled,
            "t1_host": cache.t1_enabled,
            "t2_peer": self.t2_enabled,
            "nvme": nvme.mode if nvme is not None else "absent",
            "generation": self.config.generation if self.config is not None else None,
            # Polls of the fleet config file, and the one whose content is in force (0: the
            # file as it was at start): a change applies at the first poll that sees it.
            "config_polls": watcher.num_polls if watcher is not None else 0,
            "applied_at_poll": watcher.applied_at_poll if watcher is not None else 0,
        }

    def serving_peers(self) -> bool:
        return self.t2_enabled

    def held_for_peers(self, chain: Sequence[bytes], tenant: str | None = None) -> int:
        if not self.t2_enabled:
            return 0
        return self.cache.num_held(cast(Sequence[BlockHash], chain), tenant)

    def t2_report(self) -> dict[str, Any]:
        """What this replica fetched from peers so far (for reports; the router ignores it)."""
        stats = self.tier.fetcher.stats if self.tier is not None else None
        return {
            "hint_index": hint_index_kind(self.index),
            "fetches": dict(stats.outcomes) if stats is not None else {},
            "blocks_fetched": stats.blocks_fetched if stats is not None else 0,
            "blocks_fetched_over_nixl": stats.blocks_over_nixl if stats is not None else 0,
            "nixl": self.nixl is not None,
            "bytes_fetched": stats.bytes_fetched if stats is not None else 0,
        }

    def _reload_config(self, content: bytes | None = None) -> None:
        """Load the fleet config (`content`: what the watcher read, else the file) and apply it;
        a config that does not parse keeps the last good one. Runs in a worker thread after the
        start (a T0 drain copies)."""
        path = self.settings.fleet_config
        if path is None:
            return
        watcher = self._watcher
        new = next_fleet_config(path, content, self.config, watcher)
        if watcher is not None and watcher.error:
            self.replica.config_errors["fleet"] = watcher.error
        if new is None:
            return
        self.config = new
        # A vLLM replica serves T2 on its connector's port, not its API port (`peer_url`).
        self._peer_urls = {
            r.name: r.peer_url or r.url
            for r in new.replicas
            if r.ready and r.name != self.settings.name
        }
        self.apply_tiers(new)
        if content is not None and watcher is not None:
            watcher.accept(content)
        self.replica.config_errors.pop("fleet", None)

    def apply_tiers(self, config: FleetConfig) -> None:
        """Every tier toggle of the fleet config, live."""
        toggles = config.tiers
        self.t2_enabled = toggles.t2_peer
        if self.tier is not None:
            self.tier.enabled = toggles.t2_peer
        if toggles.t1_host != self.cache.t1_enabled:
            removed = self.cache.set_t1_enabled(toggles.t1_host)
            log.info("T1 %s (%d blocks drained)", "on" if toggles.t1_host else "off", removed)
        # After T1: T0 off demotes into T1 only when T1 is (now) on.
        self.replica.t0_device = toggles.t0_device
        self.replica.sync_t0()
        nvme = self.replica.nvme
        if nvme is not None:
            nvme.set_mode(mode_for(toggles.nvme, toggles.nvme_shadow))

    async def _background(self) -> None:
        loop = asyncio.get_running_loop()
        next_register = 0.0
        while True:
            now = loop.time()
            if now >= next_register:
                next_register = now + self.settings.register_every_s
                await self.index.register_host(self.settings.name, self.settings.peer_url)
            secrets = self.settings.secrets
            if secrets is not None and await asyncio.to_thread(secrets.reload):
                self._rotate(secrets)
            if self._watcher is not None:
                content = await asyncio.to_thread(self._watcher.poll)
                if content is not None:
                    await asyncio.to_thread(self._reload_config, content)
                elif not self._watcher.error:
                    self.replica.config_errors.pop("fleet", None)
            await asyncio.sleep(self.settings.config_poll_s)

    def _rotate(self, secrets: PeerSecrets) -> None:
        """The peer secret file changed: sign with its first secret from now on (the routes
        already accept every one of them: they hold the same `PeerSecrets`)."""
        self.settings.secret = secrets.signing
        if self.tier is not None:
            self.tier.fetcher.secret = secrets.signing
        if isinstance(self.index, PeerProbeHintIndex):
            self.index.secret = secrets.signing
        log.info("peer secrets reloaded: %d accepted", len(secrets.accepted))

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        self.session = aiohttp.ClientSession()
        fetcher = PeerFetcher(
            self.settings.secret,
            self.index,
            self.settings.name,
            timeout_s=self.settings.fetch_timeout_s,
            max_concurrency=self.settings.max_concurrent_fetches,
            min_blocks=self.settings.min_fetch_blocks,
            resolve_url=self._resolve,
        )
        self.tier = PeerTier(fetcher, self.cache.layout, asyncio.get_running_loop(),
                             max_fetch_blocks=self.settings.max_fetch_blocks, nixl=self.nixl)
        self.tier.enabled = self.t2_enabled
        self.replica.peers = self.tier
        self.replica.wire_tiers()
        path = self.settings.fleet_config
        # Before the first load (see ConfigFileWatcher): a write in between is seen, not missed.
        self._watcher = None if path is None else ConfigFileWatcher(path)
        self._reload_config()
        log.info("fleet tier %s: hint index %s", self.settings.name, hint_index_kind(self.index))
        self.publisher.start(self.replica.supervisor)
        task = self.replica.supervisor.start("kvfleet-fleet-tier", self._background)
        yield
        self.replica.peers = None
        self.replica.wire_tiers()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.publisher.close()
        await self.index.close()
        await self.session.close()
        self.leases.release_all()
        if self.nixl is not None:
            self.nixl.close()


def attach_fleet(app: web.Application, replica: Replica, settings: FleetSettings) -> FleetTier:
    """Add the fleet tier's routes, listeners and background tasks to a replica's app."""
    fleet = FleetTier(replica, settings)
    source = CacheBlockSource(fleet.cache, held=fleet.cache.num_held)
    app.add_routes(
        peer_routes(
            _GatedSource(source, fleet.serving_peers),
            settings.secrets or settings.secret,
            held=fleet.held_for_peers,
            body_timeout_s=settings.peer_body_timeout_s,
        )
    )
    agent = fleet.nixl
    serving = None if agent is None else agent.serving()
    app.add_routes(
        lease_routes(
            _GatedSource(source, fleet.serving_peers),
            settings.secrets or settings.secret,
            serving,
            fleet.leases,
            body_timeout_s=settings.peer_body_timeout_s,
        )
    )

    async def load(request: web.Request) -> web.StreamResponse:
        return web.json_response(fleet.load_report())

    app.router.add_get(LOAD_PATH, load)
    app.cleanup_ctx.append(fleet.lifecycle)
    return fleet


def settings_from_env(port: int) -> FleetSettings | None:
    """`FleetSettings.from_env(os.environ, port=port)`."""
    return FleetSettings.from_env(os.environ, port=port)
