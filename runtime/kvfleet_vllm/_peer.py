"""T2 for a vLLM replica: the connector's host pool joins kvfleet's fleet tier.

One daemon thread in vLLM's engine-core process (the scheduler's process) runs an asyncio loop
with:

- the peer server: kvfleet's own T2 routes (`fleet.peer_routes`: `POST /kv/v1/blocks` and the
  held probe, the same authenticated protocol and tenant-scoped credential as a kvfleet
  replica's) on `kvfleet.peer_port`, reading the host pool: a run goes out from its slots as
  they lie to a fetcher that lands the pool's order (another connector), gathered into canonical
  rows for one that lands those (a kvfleet replica). The key is the same as a kvfleet replica's
  (docs/vllm.md "The key"), so any kvfleet replica or connector can fetch;
- the hint publisher: a block is offered to the hint index when it becomes visible in the host
  pool (saved and its step done, or fetched and verified) and withdrawn when evicted;
- the fetches: `start(...)` (called from `get_num_new_matched_tokens`) asks the hint index
  which peer holds the blocks after the host pool's match; when one holds more, slots are
  reserved (indexed pending, like a save: nothing serves them before they are written and
  checked) and the blocks are received straight into those slots (`PeerFetcher.fetch_into`: the
  header's chain hashes, dtype and layout checked before any byte lands, every chunk's checksum
  over the bytes where they landed); only the verified leading blocks become visible.
  Meanwhile the request waits (`get_num_new_matched_tokens` answers None: vLLM asks again next
  step), never past `wait_s`; then it answers from the host pool as without T2. Every failure
  (no peer, peer down, refused credential, bad checksum, timeout) leaves fewer blocks, never
  wrong ones.
- the fleet config watcher: `tiers.t2_peer` switches fetching and serving on and off live (the
  server answers 404 "not held" while off), and its replica list is the peer probe's peers when
  there is no Redis.

Settings: the same environment as a kvfleet replica (`FleetSettings.from_env`: fleet name,
Redis URL, peer secret, fleet config, peer URL) plus the extra config's `kvfleet.peer_port`
(no port, no fleet settings or no secret: no T2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvfleet_runtime.api import AppRunner, ListenerLimits, error_middleware, handler_args
from kvfleet_runtime.cache import BLOCK_SIZE, BlockEvent, CacheKey
from kvfleet_runtime.config.fleet import FleetConfig, next_fleet_config
from kvfleet_runtime.config.watch import ConfigFileWatcher
from kvfleet_runtime.fleet import (
    ExportedRun,
    FetchStats,
    FleetSettings,
    HintIndex,
    HintPublisher,
    PeerFetcher,
    PeerProbeHintIndex,
    PeerSecrets,
    WireOrder,
    best_peer,
    hint_index_for,
    peer_routes,
)
from kvfleet_vllm._connector_index import ConnectorIndex, FetchWant, Reservation
from kvfleet_vllm._copy import HostPool

__all__ = ["DEFAULT_WAIT_S", "FetchJob", "PeerService"]

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 2.5
"""The longest a request waits for a fetch: the fetch's own timeout (2 s) plus the hint lookup's
budget and a margin. Past it the request is scheduled from what the host pool holds."""
LOOKUP_WAIT_S = 0.005
"""How long `start` waits for the hint index's answer before handing the request back to vLLM
for a step: an answer within it ("nobody has more") costs the request no step at all."""

_T = TypeVar("_T")


@dataclass(slots=True)
class FetchJob:
    """One request's fetch, shared between the scheduler thread and the T2 thread."""

    want: FetchWant
    deadline: float
    decided: threading.Event = field(default_factory=threading.Event)
    """Set when the hint index answered: no fetch (`done` too), or slots reserved."""
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = ""
    """"ok", "partial_<why>", or why nothing was fetched ("no_peer", "refused", ...)."""
    peer: str = ""
    num_reserved: int = 0
    num_written: int = 0


class _Source:
    """`fleet.BlockSource` over the connector's index and host pool (serving peers)."""

    def __init__(self, service: PeerService) -> None:
        self.service = service

    async def export(self, key: CacheKey, token_ids: Sequence[int], start_block: int,
                     max_blocks: int) -> ExportedRun | None:
        service = self.service
        if not service.enabled:
            return None
        index, pool = service.index, service.pool
        # Off the loop: hashing a long prompt and waiting for the scheduler's lock take time.
        run = await asyncio.to_thread(index.export, key, token_ids, start_block, max_blocks)
        if run is None:
            return None
        slot_of: dict[bytes, int] = {node.block_hash: node.block_id for node in run}
        layout = index.layout
        released = False

        def read(hashes: Sequence[bytes], order: WireOrder, out: memoryview) -> bool:
            # A fetcher that lands another order than the pool's (a kvfleet replica's canonical
            # rows): gathered into it. The run is referenced until `release`: its slots hold
            # these blocks meanwhile.
            if any(h not in slot_of for h in hashes):
                return False
            pool.read_into([slot_of[h] for h in hashes], order, out)
            return True

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                index.release_export(run)

        run_slots = [node.block_id for node in run]

        def views(lo: int, hi: int) -> list[memoryview]:
            # Sent from the pool as it lies: the run is referenced until `release`, and a
            # referenced block's slot is neither reused nor rewritten (the pool is one tier,
            # nothing moves), so these bytes cannot change while they stream.
            return pool.wire_views(run_slots[lo:hi])

        return ExportedRun(start_block, tuple(n.block_hash for n in run), layout.dtype,
                           (layout.num_layers, layout.num_kv_heads, layout.head_dim),
                           layout.bytes_per_block, read, release, views, pool.order)


class PeerService:
    """The connector's fleet tier (see the module docstring); `start()` runs it."""

    def __init__(
        self, index: ConnectorIndex, pool: HostPool, settings: FleetSettings, *,
        port: int, bind_host: str = "0.0.0.0", wait_s: float = DEFAULT_WAIT_S,
        hints: HintIndex | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not settings.secret:
            raise ValueError("T2 needs the fleet's peer secret (KVFLEET_PEER_SECRET or "
                             "KVFLEET_PEER_SECRET_FILE)")
        self.index = index
        self.pool = pool
        self.settings = settings
        self.port = port
        self.bind_host = bind_host
        self.wait_s = wait_s
        self.clock = clock
        self.enabled = True
        """`tiers.t2_peer` of the fleet config (fetch and serve, both ways at once)."""
        self.config: FleetConfig | None = None
        self._peer_urls: dict[str, str] = {}
        self.hints = hints if hints is not None else hint_index_for(settings, self._peers)
        self.publisher = HintPublisher(self.hints, settings.name)
        self.stats = FetchStats()
        self._jobs: dict[str, FetchJob] = {}
        self._tried: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._fetcher: PeerFetcher | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._watcher: ConfigFileWatcher | None = None
        self._in_flight: set[asyncio.Task[None]] = set()
        index.add_listener(self._on_event)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the thread, bind the peer server and load the fleet config; raises what the
        server's start raised (a port in use is a startup error, not a silent T2-off)."""
        self._thread = threading.Thread(target=self._main, name="kvfleet-t2", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"kvfleet T2 thread did not start within {timeout_s} s")
        if self._failure is not None:
            raise self._failure

    def close(self, timeout_s: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or self._thread is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout_s)
        self._thread = None

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to `start`; after startup only logged
            if not self._ready.is_set():
                self._failure = exc
                self._ready.set()
            else:
                log.exception("kvfleet T2 thread stopped")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        settings = self.settings
        # The listener's limits and error envelope (`kvfleet_runtime.api`), as on a replica.
        app = web.Application(middlewares=[error_middleware(log)],
                              handler_args=handler_args(ListenerLimits()))
        # The routes hold the same `PeerSecrets` the poll reloads: a rotation needs no restart.
        app.add_routes(peer_routes(_Source(self), settings.secrets or settings.secret,
                                   held=self._held))
        self._runner = AppRunner(app, access_log=None)
        await self._runner.setup()
        # Bound here so that port 0 ("any free port", for tests) is known before publishing.
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.bind_host, self.port))
        except OSError:
            sock.close()
            raise
        if self.port == 0:
            self.port = int(sock.getsockname()[1])
            if settings.peer_url.endswith(":0"):
                settings.peer_url = settings.peer_url[:-1] + str(self.port)
        await web.SockSite(self._runner, sock).start()
        self._session = aiohttp.ClientSession()
        self._fetcher = PeerFetcher(settings.secret, self.hints, settings.name,
                                    timeout_s=settings.fetch_timeout_s,
                                    max_concurrency=settings.max_concurrent_fetches,
                                    min_blocks=settings.min_fetch_blocks)
        path = settings.fleet_config
        self._watcher = None if path is None else ConfigFileWatcher(path)
        self._reload_config()
        self.publisher.start()
        await self.hints.register_host(settings.name, settings.peer_url)
        log.info("kvfleet T2 %s: serving peers on %s:%d, hint index %s", settings.name,
                 self.bind_host, self.port, type(self.hints).__name__)
        self._ready.set()
        try:
            await self._background()
        finally:
            for task in list(self._in_flight):
                task.cancel()
            await asyncio.gather(*self._in_flight, return_exceptions=True)
            await self.publisher.close()
            await self.hints.close()
            await self._session.close()
            await self._runner.cleanup()

    async def _background(self) -> None:
        assert self._stop is not None
        loop = asyncio.get_running_loop()
        next_register = loop.time() + self.settings.register_every_s
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.config_poll_s)
            if loop.time() >= next_register:
                next_register = loop.time() + self.settings.register_every_s
                await self.hints.register_host(self.settings.name, self.settings.peer_url)
            secrets = self.settings.secrets
            if secrets is not None and await asyncio.to_thread(secrets.reload):
                self._rotate(secrets)
            # A poll that sees new content waits for the file to settle: off the loop.
            if self._watcher is not None:
                content = await asyncio.to_thread(self._watcher.poll)
                if content is not None:
                    self._reload_config(content)

    def _rotate(self, secrets: PeerSecrets) -> None:
        """The peer secret file changed: sign with its first secret from now on (the routes
        already accept every one of them), as a kvfleet replica's fleet tier does."""
        self.settings.secret = secrets.signing
        if self._fetcher is not None:
            self._fetcher.secret = secrets.signing
        if isinstance(self.hints, PeerProbeHintIndex):
            self.hints.secret = secrets.signing
        log.info("kvfleet T2 %s: peer secrets reloaded, %d accepted", self.settings.name,
                 len(secrets.accepted))

    def _reload_config(self, content: bytes | None = None) -> None:
        """Apply the fleet config: `content` as the watcher read it, else the file (startup)."""
        path = self.settings.fleet_config
        if path is None:
            return
        watcher = self._watcher
        config = next_fleet_config(path, content, self.config, watcher)
        if config is None:
            return
        if content is not None and watcher is not None:
            watcher.accept(content)
        self.config = config
        # Another vLLM replica serves T2 on its connector's port, not its API port (`peer_url`).
        self._peer_urls = {r.name: r.peer_url or r.url for r in config.replicas
                           if r.ready and r.name != self.settings.name}
        if config.tiers.t2_peer != self.enabled:
            log.info("kvfleet T2 %s", "on" if config.tiers.t2_peer else "off")
        self.enabled = config.tiers.t2_peer

    def _peers(self) -> dict[str, str]:
        return self._peer_urls

    def call(self, coro: Coroutine[Any, Any, _T], timeout_s: float = 10.0) -> _T:
        """Run `coro` on the T2 loop and wait for it (tests; the hint index lives there)."""
        assert self._loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # -- publishing and serving ------------------------------------------------------------

    def _on_event(self, event: BlockEvent) -> None:
        # Called under the index's lock from either thread; the publisher only queues.
        if event.kind == "stored":
            self.publisher.offer_stored(event.block_hashes, tenant=event.key.tenant_id)
        else:
            self.publisher.offer_removed(event.block_hashes, tenant=event.key.tenant_id)

    def _held(self, hashes: Sequence[bytes], tenant: str) -> int:
        return self.index.held(hashes, tenant) if self.enabled else 0

    # -- fetching (the scheduler thread calls these) ---------------------------------------

    def poll(self, req_id: str, key: CacheKey, token_ids: Sequence[int],
             num_local_tokens: int) -> bool:
        """True while the request should wait for a fetch of its next blocks (vLLM asks again
        next step); False when the host pool's answer is final for this request: nothing to
        fetch, or the fetch finished, failed or ran out of time."""
        job = self._jobs.get(req_id)
        if job is None:
            if req_id in self._tried or not self.enabled or self._loop is None:
                return False
            self._tried.add(req_id)
            want = self.index.fetch_want(key, token_ids, num_local_tokens,
                                         max(1, self.settings.min_fetch_blocks))
            if want is None:
                return False
            job = FetchJob(want, self.clock() + self.wait_s)
            try:
                self._loop.call_soon_threadsafe(self._spawn, job, list(token_ids))
            except RuntimeError:  # the T2 thread is gone (logged when it stopped): no T2
                self._loop = None
                return False
            self._jobs[req_id] = job
            job.decided.wait(LOOKUP_WAIT_S)
        if job.done.is_set() or self.clock() >= job.deadline:
            # A fetch past the deadline still completes in the background (its blocks then
            # serve later requests); this one goes ahead with what is visible now.
            del self._jobs[req_id]
            return False
        return True

    def forget(self, req_id: str) -> None:
        """The request finished (or was aborted): drop its bookkeeping."""
        self._jobs.pop(req_id, None)
        self._tried.discard(req_id)

    def _spawn(self, job: FetchJob, token_ids: list[int]) -> None:
        task = asyncio.create_task(self._fetch(job, token_ids))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _fetch(self, job: FetchJob, token_ids: list[int]) -> None:
        reservation: Reservation | None = None
        try:
            reservation = await self._reserve(job)
            if reservation is not None:
                job.num_written = await self._transfer(job, reservation, token_ids)
        except asyncio.CancelledError:
            job.outcome = job.outcome or "cancelled"
            raise
        except Exception:  # never wrong data and never a failed request: recompute
            log.exception("kvfleet T2 fetch failed; recomputing")
            job.outcome = "error"
        finally:
            if reservation is not None:
                self.index.fetch_done(reservation, job.num_written)
            self.stats.count(job.outcome or "error")
            self.stats.blocks_fetched += job.num_written
            job.decided.set()
            job.done.set()

    async def _reserve(self, job: FetchJob) -> Reservation | None:
        want = job.want
        wanted = want.chain[want.start_block:]
        runs = await self.hints.lookup_runs(wanted, tenant=want.key.tenant_id)
        peer = best_peer(runs, exclude=self.settings.name)
        useful = want.useful_blocks - want.start_block  # blocks vLLM holds itself anyway
        if peer is None or peer[1] - useful < max(1, self.settings.min_fetch_blocks):
            job.outcome = "no_peer"
            return None
        reservation = self.index.reserve(want, peer[1])
        if reservation is None:
            job.outcome = "no_room"
            return None
        job.peer, job.num_reserved = peer[0], len(reservation.slots)
        job.decided.set()
        return reservation

    async def _transfer(self, job: FetchJob, reservation: Reservation,
                        token_ids: list[int]) -> int:
        """Fetch the reserved blocks from `job.peer` and write the verified ones; returns how
        many leading reserved blocks now hold the right KV."""
        assert self._fetcher is not None
        url = self._url(job.peer) or await self.hints.host_url(job.peer)
        if url is None:
            job.outcome = "no_url"
            return 0
        want, start, slots = reservation.want, reservation.start_block, reservation.slots
        key, layout = want.key, self.index.layout
        tokens = token_ids[:(start + len(slots)) * BLOCK_SIZE]
        pool = self.pool

        def landing(lo: int, hi: int) -> list[memoryview]:
            return pool.wire_views(slots[lo:hi])

        # Straight into the reserved slots: they are pending (no lookup plans a load from
        # them), the header is checked before any byte lands, and only the verified leading
        # blocks are reported written; `fetch_done` cuts the rest from every match.
        try:
            written, partial = await asyncio.wait_for(
                self._fetcher.fetch_into(
                    url, key, tokens, want.chain[start:start + len(slots)], start_block=start,
                    dtype=layout.dtype,
                    layout=(layout.num_layers, layout.num_kv_heads, layout.head_dim),
                    landing=landing, order=pool.order),
                self.settings.fetch_timeout_s)
        except TimeoutError:
            job.outcome = "timeout"
            return 0
        except Exception as exc:  # FetchFailed (refused, stale, checksum...), connection errors
            job.outcome = str(getattr(exc, "outcome", "peer_error"))
            log.info("kvfleet T2 fetch from %s failed: %r", job.peer, exc)
            return 0
        self.stats.bytes_fetched += written * layout.bytes_per_block
        job.outcome = f"partial_{partial}" if partial else "ok"
        return written

    def _url(self, host: str) -> str | None:
        if self.config is None:
            return None
        return next((r.peer_url or r.url for r in self.config.replicas if r.name == host), None)

    # -- observation -----------------------------------------------------------------------

    @property
    def num_jobs(self) -> int:
        """Fetches a request still waits for."""
        return len(self._jobs)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no fetch is running (tests): True when idle."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self._in_flight and all(j.done.is_set() for j in self._jobs.values()):
                return True
            time.sleep(0.005)
        return False
