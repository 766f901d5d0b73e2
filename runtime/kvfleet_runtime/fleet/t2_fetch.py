"""T2, the fetching side: `PeerFetcher` finds the peer with the longest run (the hint index),
receives it in place (`fleet._receive`), verifies it, and says why when it gives up
(`FetchOutcome`); `fleet.t2_protocol` has the format, the credential and the checksum. Over NIXL
(`PeerFetcher.receive_leased`): the control request leases the run, the fetcher READs it
one-sided into its own registered blocks (`fleet.t2_nixl`) within the lease's life and
releases the lease."""

from __future__ import annotations

import asyncio
import base64
import enum
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey
from kvfleet_runtime.fleet._receive import BodyReader, post
from kvfleet_runtime.fleet.hint_index import HintIndex, best_peer
from kvfleet_runtime.fleet.t2_lease import PoolGeometry, pair_descriptors
from kvfleet_runtime.fleet.t2_protocol import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREAMBLE,
    U32,
    U64,
    VERSION,
    BufferPool,
    WireOrder,
    chunk_checksum,
    peer_token,
)
from kvfleet_runtime.wire import LEASE_PATH, RELEASE_PATH, T2_PATH, TENANT_HEADER

if TYPE_CHECKING:
    from kvfleet_runtime.fleet.t2_nixl import NixlAgent

__all__ = [
    "FETCH_SECONDS_BUCKETS",
    "FetchFailed",
    "FetchOutcome",
    "FetchStats",
    "FetchedRun",
    "Landing",
    "PeerFetcher",
    "PeerRun",
]

log = logging.getLogger(__name__)

class FetchOutcome(enum.StrEnum):
    """How a fetch ended: `OK`, a run cut short (`PARTIAL_*`: its verified leading chunks kept),
    or why the request went back to recompute. Values are the metric labels."""

    OK = "ok"
    PARTIAL_SHORT_READ = "partial_short_read"
    PARTIAL_PROTOCOL = "partial_protocol"
    PARTIAL_CHECKSUM = "partial_checksum"
    DISABLED = "disabled"
    """No peer secret: T2 is off."""
    TOO_SHORT = "too_short"
    NO_PEER = "no_peer"
    NO_URL = "no_url"
    BUSY = "busy"
    """Every transfer slot taken for `queue_wait_s`."""
    TIMEOUT = "timeout"
    PEER_ERROR = "peer_error"
    STALE = "stale"
    """The peer no longer holds the run (404)."""
    REFUSED = "refused"
    HTTP = "http"
    PROTOCOL = "protocol"
    TOO_LARGE = "too_large"
    SHORT_READ = "short_read"
    CHECKSUM = "checksum"
    HASH_MISMATCH = "hash_mismatch"
    LAYOUT_MISMATCH = "layout_mismatch"
    ERROR = "error"
    """The fleet tier's import of a fetched run failed."""
    LOCAL_EVICTED = "local_evicted"
    """The local prefix the run continues was evicted before the import."""
    # The vLLM connector's peer tier (kvfleet_vllm._peer) counts into the same FetchStats:
    CANCELLED = "cancelled"
    NO_ROOM = "no_room"
    """No host-pool slots to land the run in."""
    REJECTED = "rejected"
    """The run failed the connector's own check of chain, dtype or layout."""
    # T2 over NIXL (`PeerFetcher.receive_leased`):
    NIXL = "nixl"
    """The one-sided READ failed: the peer went away mid-read, its agent or descriptors are
    stale (a restarted peer), or the read ran past the deadline."""
    LEASE_EXPIRED = "lease_expired"
    """The read completed after the peer's lease may have run out (its life counted from
    before the request, on this side's clock): its blocks may have been reused mid-read, so the
    bytes are not used."""
    LEASE_BUDGET = "lease_budget"
    """The peer had too many blocks leased already (429)."""

    @property
    def partial(self) -> FetchOutcome:
        """The outcome of a run this failure cut short (after at least one verified chunk)."""
        return FetchOutcome(f"partial_{self.value}")


@dataclass(slots=True)
class FetchedRun:
    """Verified blocks [start_block, start_block + num_blocks). `k`/`v` hold
    `[layers, kv_heads, capacity_blocks * 16, head_dim]` in canonical layout, of which the first
    `num_blocks * 16` tokens are filled (fewer than announced when the peer stopped early)."""

    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    layout: tuple[int, int, int]
    capacity_blocks: int
    k: memoryview
    v: memoryview
    peer: str = ""
    partial: FetchOutcome | None = None
    """Why the run ended before the announced length (None when complete)."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


FETCH_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper edges of the transfer-time histogram (`kvfleet_t2_fetch_seconds`): a run of 2,000
tokens of the reference model is ~26 ms over RDMA, seconds over a slow TCP path."""


@dataclass(slots=True)
class FetchStats:
    """Outcome counts: `ok` or the reason the request went back to recompute; and the transfer
    time of every run that landed (`fetch_seconds_counts[i]`: transfers within bucket i's edge,
    not cumulative; the last entry counts those above every edge)."""

    outcomes: dict[FetchOutcome, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    blocks_fetched: int = 0
    blocks_over_nixl: int = 0
    """Of `blocks_fetched`, those read over NIXL (`PeerFetcher.receive_leased`)."""
    fetch_seconds_counts: list[int] = field(
        default_factory=lambda: [0] * (len(FETCH_SECONDS_BUCKETS) + 1))
    fetch_seconds_sum: float = 0.0

    def count(self, outcome: FetchOutcome | str) -> None:
        """One more `outcome` (a FetchOutcome's value is taken too: ValueError for any other)."""
        key = FetchOutcome(outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def time(self, seconds: float) -> None:
        """One more landed transfer that took `seconds` (request to its last verified byte)."""
        i = next((i for i, edge in enumerate(FETCH_SECONDS_BUCKETS) if seconds <= edge),
                 len(FETCH_SECONDS_BUCKETS))
        self.fetch_seconds_counts[i] += 1
        self.fetch_seconds_sum += seconds


Landing = Callable[[int, int], Sequence[memoryview]]
"""Where a run's bytes land, for `PeerFetcher.fetch_into`: `landing(lo, hi)` is the views that
blocks [lo, hi) of the run (0 = its first block) fill, in the wire order the fetch asks for
(`t2_protocol.WireOrder`: canonical, each K row `[layer][kv_head]` then each V row; LBHNC, each
layer's blocks), exactly `(hi - lo) * bytes_per_block` bytes in all (e.g. slices of the caller's
pool)."""


@dataclass(frozen=True, slots=True)
class PeerRun:
    """A peer holding a run of the chain asked for (`PeerFetcher.find`): its name, its T2 URL
    and how many leading blocks of the asked chain it holds."""

    host: str
    url: str
    num_blocks: int


class FetchFailed(Exception):
    def __init__(self, outcome: FetchOutcome, detail: str = "") -> None:
        super().__init__(f"{outcome}: {detail}" if detail else outcome)
        self.outcome = outcome


class PeerFetcher:
    """Finds the peer with the longest run (via the hint index) and fetches it, or gives up.

    Never raises: `fetch` returns a verified `FetchedRun` or None, and counts why in `stats`.
    `max_concurrency` transfers run at once; a request that finds them all busy for
    `queue_wait_s` recomputes instead of queueing. Transfers use a connection of their own each
    (`fleet._receive`, receiving in place)."""

    def __init__(
        self,
        secret: bytes | None,
        index: HintIndex,
        self_host: str,
        *,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.25,
        max_concurrency: int = 4,
        queue_wait_s: float = 0.005,
        max_bytes: int = 8 << 30,
        min_blocks: int = 1,
        resolve_url: Callable[[str], str | None] | None = None,
    ) -> None:
        self.secret = secret
        self.index = index
        self.self_host = self_host
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.queue_wait_s = queue_wait_s
        self.max_bytes = max_bytes
        self.min_blocks = min_blocks
        self.resolve_url = resolve_url
        self.stats = FetchStats()
        self._slots = asyncio.Semaphore(max_concurrency)
        # Receive buffers given back by `recycle`: first-touch page faults of fresh memory cost
        # more than the copy itself (hundreds of MiB per fetch), so steady state reuses them.
        self._spare = BufferPool(2 * max_concurrency + 2)
        # T2 over NIXL: the agent name each peer URL answered (its metadata is loaded once), and
        # the peers that answered they have no NIXL (fetched over HTTP until `_NO_NIXL_RETRY_S`).
        self._agents: dict[str, str] = {}
        self._no_nixl: dict[str, float] = {}
        self._releases: set[asyncio.Future[None]] = set()

    def _buffer(self, num_bytes: int) -> memoryview:
        return self._spare.take(num_bytes).data.cast("B")[:num_bytes]

    def recycle(self, run: FetchedRun) -> None:
        """Give a run's buffers back once nothing references them any more (after
        `import_blocks` copied them into the cache). Optional: unrecycled runs are just freed."""
        for view in (run.k, run.v):
            base = view.obj
            if isinstance(base, np.ndarray):
                self._spare.give(base)

    async def fetch(
        self,
        key: CacheKey,
        token_ids: Sequence[int],
        expected_hashes: Sequence[bytes],
        *,
        start_block: int = 0,
        expected_dtype: str | None = None,
        expected_layout: tuple[int, int, int] | None = None,
    ) -> FetchedRun | None:
        """Fetch blocks [start_block, ...) of (key, token_ids) from the best peer.

        `expected_hashes` is the full chain the caller computed for `token_ids`;
        `expected_layout` is (num_layers, num_kv_heads, head_dim)."""
        wanted = list(expected_hashes[start_block:])
        peer = await self.find(key, wanted)
        if peer is None:
            return None
        host, url, num_blocks = peer.host, peer.url, peer.num_blocks
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_wait_s)
        except TimeoutError:
            self.stats.count(FetchOutcome.BUSY)
            return None
        started_s = time.monotonic()
        try:
            run = await asyncio.wait_for(
                self.fetch_from(url, key, token_ids, start_block, num_blocks), self.timeout_s
            )
        except TimeoutError:
            self.stats.count(FetchOutcome.TIMEOUT)
            return None
        except FetchFailed as exc:
            self.stats.count(exc.outcome)
            log.debug("T2 fetch from %s failed: %s", host, exc)
            return None
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: malformed HTTP
            self.stats.count(FetchOutcome.PEER_ERROR)
            log.debug("T2 fetch from %s failed: %r", host, exc)
            return None
        finally:
            self._slots.release()
        try:
            self._verify(run, wanted, start_block, expected_dtype, expected_layout)
        except FetchFailed as exc:
            self.stats.count(exc.outcome)
            log.warning("T2 run from %s rejected: %s", host, exc)
            return None
        run.peer = host
        self.stats.count(FetchOutcome.OK if run.partial is None else run.partial.partial)
        self.stats.bytes_fetched += 2 * len(run.k) * run.num_blocks // run.capacity_blocks
        self.stats.blocks_fetched += run.num_blocks
        self.stats.time(time.monotonic() - started_s)
        return run

    async def find(self, key: CacheKey, wanted: Sequence[bytes]) -> PeerRun | None:
        """The peer with the longest run of `wanted` (the chain from the first block asked
        for), as the hint index knows it, or None (counted: disabled, too short, no peer, no
        URL). Asks the index only: no transfer."""
        if not self.secret:
            self.stats.count(FetchOutcome.DISABLED)
            return None
        if len(wanted) < self.min_blocks:
            self.stats.count(FetchOutcome.TOO_SHORT)
            return None
        runs = await self.index.lookup_runs(list(wanted), tenant=key.tenant_id)
        peer = best_peer(runs, exclude=self.self_host)
        if peer is None or peer[1] < self.min_blocks:
            self.stats.count(FetchOutcome.NO_PEER)
            return None
        host, num_blocks = peer
        url = await self._url(host)
        if url is None:
            self.stats.count(FetchOutcome.NO_URL)
            return None
        return PeerRun(host, url, min(num_blocks, len(wanted)))

    async def receive_into(
        self,
        peer: PeerRun,
        key: CacheKey,
        token_ids: Sequence[int],
        expected_hashes: Sequence[bytes],
        *,
        start_block: int,
        dtype: str,
        layout: tuple[int, int, int],
        landing: Landing,
        order: WireOrder,
    ) -> int:
        """`fetch_into` from a peer `find` found, with a transfer slot, the deadline and the
        counts `fetch` keeps: how many leading blocks landed verified (0 on any failure, counted
        in `stats`). Never raises but for cancellation."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_wait_s)
        except TimeoutError:
            self.stats.count(FetchOutcome.BUSY)
            return 0
        started_s = time.monotonic()
        try:
            verified, partial = await asyncio.wait_for(
                self.fetch_into(peer.url, key, token_ids, expected_hashes,
                                start_block=start_block, dtype=dtype, layout=layout,
                                landing=landing, order=order),
                self.timeout_s)
        except TimeoutError:
            self.stats.count(FetchOutcome.TIMEOUT)
            return 0
        except FetchFailed as exc:
            self.stats.count(exc.outcome)
            log.debug("T2 fetch from %s failed: %s", peer.host, exc)
            return 0
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: malformed HTTP
            self.stats.count(FetchOutcome.PEER_ERROR)
            log.debug("T2 fetch from %s failed: %r", peer.host, exc)
            return 0
        finally:
            self._slots.release()
        self.stats.count(FetchOutcome.OK if partial is None else partial.partial)
        self.stats.bytes_fetched += verified * _block_bytes(dtype, layout)
        self.stats.blocks_fetched += verified
        self.stats.time(time.monotonic() - started_s)
        return verified

    def serves_nixl(self, url: str) -> bool:
        """Whether to try T2 over NIXL with this peer: False for a while after it answered it
        has no NIXL agent (then the HTTP path)."""
        since = self._no_nixl.get(url)
        return since is None or time.monotonic() - since > _NO_NIXL_RETRY_S

    async def receive_leased(
        self,
        peer: PeerRun,
        key: CacheKey,
        token_ids: Sequence[int],
        expected_hashes: Sequence[bytes],
        *,
        start_block: int,
        dtype: str,
        layout: tuple[int, int, int],
        agent: NixlAgent,
        local_slots: Sequence[tuple[int, int]],
    ) -> int | None:
        """`receive_into` over NIXL: lease the run from `peer`, READ it one-sided into
        `local_slots` ((pool, slot) of this replica's registered pools, `agent.geometries`), and
        release the lease. How many leading blocks hold the run's verified KV (0 on any failure,
        counted in `stats`: the engine recomputes), or None when the peer has no NIXL agent
        (nothing counted: the caller fetches over HTTP). Never raises but for cancellation; a
        read in flight is waited for even then (its bytes land in `local_slots`)."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_wait_s)
        except TimeoutError:
            self.stats.count(FetchOutcome.BUSY)
            return 0
        started_s = time.monotonic()
        try:
            verified = await self.lease_into(
                peer.url, key, token_ids, expected_hashes, start_block=start_block,
                dtype=dtype, layout=layout, agent=agent, local_slots=local_slots,
                deadline_s=started_s + self.timeout_s)
        except _NoNixl:
            self._no_nixl[peer.url] = time.monotonic()
            return None
        except TimeoutError:
            self.stats.count(FetchOutcome.TIMEOUT)
            return 0
        except FetchFailed as exc:
            self.stats.count(exc.outcome)
            log.debug("T2 NIXL fetch from %s failed: %s", peer.host, exc)
            return 0
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: malformed HTTP
            self.stats.count(FetchOutcome.PEER_ERROR)
            log.debug("T2 NIXL fetch from %s failed: %r", peer.host, exc)
            return 0
        finally:
            self._slots.release()
        self._no_nixl.pop(peer.url, None)
        self.stats.count(FetchOutcome.OK)
        self.stats.bytes_fetched += verified * _block_bytes(dtype, layout)
        self.stats.blocks_fetched += verified
        self.stats.blocks_over_nixl += verified
        self.stats.time(time.monotonic() - started_s)
        return verified

    async def lease_into(
        self,
        url: str,
        key: CacheKey,
        token_ids: Sequence[int],
        expected_hashes: Sequence[bytes],
        *,
        start_block: int,
        dtype: str,
        layout: tuple[int, int, int],
        agent: NixlAgent,
        local_slots: Sequence[tuple[int, int]],
        deadline_s: float,
    ) -> int:
        """One T2 transfer over NIXL from a known peer, by `deadline_s` (monotonic): the
        blocks verified (all the peer leased: a READ lands whole or not at all). Nothing is
        read before the answer is checked: the run must start at `start_block`, be no longer
        than asked, carry exactly the leading hashes of `expected_hashes`, this replica's dtype
        and layout, and describe blocks of that size inside the pools it names. The bytes count
        only when the READ completed within the lease's life, counted from before the request
        was sent (the peer granted it later, so it was live all along); the release goes out
        after, off the transfer's path. Raises FetchFailed (with the outcome), TimeoutError,
        aiohttp and OS errors, `_NoNixl`."""
        n_wanted = len(expected_hashes)
        body = {"key": key._asdict(), "token_ids": list(token_ids), "start_block": start_block,
                "max_blocks": n_wanted, "agent": self._agents.get(url)}
        # Before the request: the lease is granted after this on any clock, so it is live at
        # least until `asked_s + ttl_s` here (`_LEASE_CLOCK_MARGIN` for the clocks' rates).
        asked_s = time.monotonic()
        status, answer = await self._post_json(url, LEASE_PATH, key.tenant_id, body, deadline_s)
        if status != 200:
            if status == 501 or (status == 404 and _error_code(answer) != "not_held"):
                raise _NoNixl  # a peer without NIXL, or one from before the lease routes
            outcome = {404: FetchOutcome.STALE, 401: FetchOutcome.REFUSED,
                       403: FetchOutcome.REFUSED,
                       429: FetchOutcome.LEASE_BUDGET}.get(status, FetchOutcome.HTTP)
            raise FetchFailed(outcome, f"HTTP {status}")
        lease = _parse_lease(answer)
        try:
            n = len(lease.block_hashes)
            if lease.dtype != dtype or lease.layout != tuple(layout):
                raise FetchFailed(FetchOutcome.LAYOUT_MISMATCH,
                                  f"{lease.dtype} {lease.layout} != {dtype} {tuple(layout)}")
            if lease.bytes_per_block != _block_bytes(dtype, layout):
                raise FetchFailed(FetchOutcome.PROTOCOL,
                                  f"{lease.bytes_per_block} bytes per block")
            if lease.start_block != start_block or not 0 < n <= min(n_wanted, len(local_slots)):
                raise FetchFailed(FetchOutcome.PROTOCOL,
                                  f"run [{lease.start_block}, +{n}) not requested")
            if lease.block_hashes != tuple(expected_hashes[:n]):
                raise FetchFailed(FetchOutcome.HASH_MISMATCH,
                                  "peer blocks are not the requested chain")
            try:
                descriptors = pair_descriptors(agent.geometries, local_slots[:n], lease.pools,
                                               lease.slots)
            except ValueError as exc:
                raise FetchFailed(FetchOutcome.LAYOUT_MISMATCH, str(exc)) from exc
            if sum(d.num_bytes for d in descriptors) != n * lease.bytes_per_block:
                raise FetchFailed(FetchOutcome.LAYOUT_MISMATCH, "descriptors of another size")
            if lease.metadata is not None:
                remote = await asyncio.to_thread(agent.add_remote, lease.metadata)
                if remote != lease.agent:
                    raise FetchFailed(FetchOutcome.PROTOCOL, f"agent {remote} != {lease.agent}")
                self._agents[url] = remote
            elif not agent.knows(lease.agent):
                raise FetchFailed(FetchOutcome.PROTOCOL, f"unknown agent {lease.agent}")
            remaining = deadline_s - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            read = asyncio.get_running_loop().run_in_executor(
                None, agent.read, descriptors, lease.agent, remaining)
            try:
                ok = await asyncio.shield(read)
            except asyncio.CancelledError:
                await asyncio.wait([read])  # its bytes land in the caller's blocks: wait it out
                raise
            if not ok:
                agent.forget(lease.agent)  # a restarted or gone peer: load it afresh next time
                self._agents.pop(url, None)
                raise FetchFailed(FetchOutcome.NIXL, f"READ from {lease.agent}")
        finally:
            # Off the transfer's path: the lease's own clock vouches for the bytes (below), the
            # release only unpins early (a lost one runs out by itself).
            self._release_later(url, key.tenant_id, lease.lease_id)
        if time.monotonic() > asked_s + lease.ttl_s * (1 - _LEASE_CLOCK_MARGIN):
            raise FetchFailed(FetchOutcome.LEASE_EXPIRED, f"lease {lease.lease_id[:8]}")
        return n

    def _release_later(self, url: str, tenant: str, lease_id: str) -> None:
        task = asyncio.ensure_future(self._release(url, tenant, lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, url: str, tenant: str, lease_id: str) -> None:
        """End a lease (the peer unpins its blocks now rather than at the lease's expiry)."""
        try:
            await self._post_json(url, RELEASE_PATH, tenant, {"lease": lease_id},
                                  time.monotonic() + self.timeout_s)
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as exc:
            log.debug("T2 lease release at %s failed (it runs out by itself): %r", url, exc)

    async def _post_json(self, url: str, path: str, tenant: str, body: Any,
                         deadline_s: float) -> tuple[int, Any]:
        """POST a control request, authenticated as the block request is; (status, JSON)."""
        assert self.secret
        headers = {TENANT_HEADER: tenant,
                   "Authorization": f"Bearer {peer_token(self.secret, tenant)}"}

        async def exchange() -> tuple[int, Any]:
            status, reader = await post(url, path, body, headers,
                                        connect_timeout_s=self.connect_timeout_s)
            try:
                _, head = await reader.head
                length = int(head.get("content-length", "0"))
                if not 0 <= length <= _MAX_CONTROL_BYTES:
                    raise ValueError(f"control answer of {length} bytes")
                raw = await reader.exactly(length)
            finally:
                reader.close()
            try:
                return status, json.loads(raw) if raw else None
            except json.JSONDecodeError as exc:
                raise ValueError(f"control answer is not JSON: {exc}") from exc

        return await asyncio.wait_for(exchange(), max(0.0, deadline_s - time.monotonic()))

    async def _url(self, host: str) -> str | None:
        if self.resolve_url is not None:
            url = self.resolve_url(host)
            if url is not None:
                return url
        return await self.index.host_url(host)

    async def fetch_from(
        self, url: str, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> FetchedRun:
        """One transfer from a known peer into canonical receive buffers, unverified against a
        chain; raises FetchFailed, aiohttp and OS errors (`fetch` is the never-raising path; the
        benchmarks call this one with a peer of their choosing)."""
        reader = await self._request(url, key, token_ids, start_block, max_blocks,
                                     WireOrder.CANONICAL)
        try:
            return await self._read_run(reader)
        finally:
            reader.close()

    async def fetch_into(
        self,
        url: str,
        key: CacheKey,
        token_ids: Sequence[int],
        expected_hashes: Sequence[bytes],
        *,
        start_block: int,
        dtype: str,
        layout: tuple[int, int, int],
        landing: Landing,
        order: WireOrder = WireOrder.CANONICAL,
    ) -> tuple[int, FetchOutcome | None]:
        """Fetch blocks `[start_block, + len(expected_hashes))` from a known peer straight into
        the caller's memory (`landing`, in wire order `order`: the peer sends that order, from
        where its blocks lie or gathered into it), with no receive buffer in between.

        Nothing lands before the header is checked: the run must start at `start_block`, be no
        longer than asked, carry exactly the leading hashes of `expected_hashes`, the caller's
        dtype and layout, and come in `order` (`FetchFailed` otherwise, the memory untouched:
        a peer that predates the order field answers canonical). Then each
        chunk is received in place and checksummed where it landed. Returns (how many leading
        blocks hold verified KV, why the run ended early or None when complete). Bytes after
        those blocks may have landed (a chunk that failed its checksum, a chunk cut short):
        the caller must never use them. Raises FetchFailed when no block was verified, and
        aiohttp and OS errors (the vLLM connector's peer tier calls this into its host pool)."""
        n_wanted = len(expected_hashes)
        reader = await self._request(url, key, token_ids, start_block, n_wanted, order)
        try:
            header = await _read_header(reader, self.max_bytes)
            # Everything that decides where bytes land is checked before the first one does.
            if (header.dtype != dtype or header.layout != tuple(layout)
                    or header.order is not order):
                raise FetchFailed(FetchOutcome.LAYOUT_MISMATCH,
                                  f"{header.dtype} {header.layout} {header.order} != "
                                  f"{dtype} {tuple(layout)} {order}")
            n = len(header.block_hashes)
            if header.start_block != start_block or n > n_wanted:
                raise FetchFailed(FetchOutcome.PROTOCOL,
                                  f"run [{header.start_block}, +{n}) not requested")
            if header.block_hashes != tuple(expected_hashes[:n]):
                raise FetchFailed(FetchOutcome.HASH_MISMATCH,
                                  "peer blocks are not the requested chain")
            verified, failure = await _read_chunks(reader, n, header.bytes_per_block, landing)
        finally:
            reader.close()
        if failure is not None:
            if verified == 0:
                raise failure
            return verified, failure.outcome
        return verified, None

    async def _request(
        self, url: str, key: CacheKey, token_ids: Sequence[int], start_block: int,
        max_blocks: int, order: WireOrder,
    ) -> BodyReader:
        """POST the block request; the reader of a 200 body (FetchFailed for any other)."""
        assert self.secret
        body = {
            "key": key._asdict(),
            "token_ids": list(token_ids),
            "start_block": start_block,
            "max_blocks": max_blocks,
            "order": order.value,
        }
        headers = {
            TENANT_HEADER: key.tenant_id,
            "Authorization": f"Bearer {peer_token(self.secret, key.tenant_id)}",
        }
        status, reader = await post(
            url, T2_PATH, body, headers, connect_timeout_s=self.connect_timeout_s
        )
        if status != 200:
            reader.close()
            outcome = {404: FetchOutcome.STALE, 401: FetchOutcome.REFUSED,
                       403: FetchOutcome.REFUSED}.get(status, FetchOutcome.HTTP)
            raise FetchFailed(outcome, f"HTTP {status}")
        return reader

    async def _read_run(self, reader: BodyReader) -> FetchedRun:
        header = await _read_header(reader, self.max_bytes)
        if header.order is not WireOrder.CANONICAL:  # asked for canonical rows: nothing else
            raise FetchFailed(FetchOutcome.LAYOUT_MISMATCH, f"order {header.order} != canonical")
        n, bytes_per_block = len(header.block_hashes), header.bytes_per_block
        run = FetchedRun(
            start_block=header.start_block,
            block_hashes=(),
            dtype=header.dtype,
            layout=header.layout,
            capacity_blocks=n,
            k=self._buffer(n * bytes_per_block // 2),
            v=self._buffer(n * bytes_per_block // 2),
        )
        verified, failure = await _read_chunks(reader, n, bytes_per_block,
                                               _buffer_landing(run, bytes_per_block))
        run.block_hashes = header.block_hashes[:verified]
        if failure is not None:
            if verified == 0:
                raise failure
            run.partial = failure.outcome
        return run

    def _verify(
        self,
        run: FetchedRun,
        wanted: Sequence[bytes],
        start_block: int,
        dtype: str | None,
        layout: tuple[int, int, int] | None,
    ) -> None:
        n = run.num_blocks
        if run.start_block != start_block or not 0 < n <= len(wanted):
            raise FetchFailed(FetchOutcome.PROTOCOL, f"run [{run.start_block}, +{n}) not requested")
        if tuple(run.block_hashes) != tuple(wanted[:n]):
            raise FetchFailed(FetchOutcome.HASH_MISMATCH, "peer blocks are not the requested chain")
        if dtype is not None and run.dtype != dtype:
            raise FetchFailed(FetchOutcome.LAYOUT_MISMATCH, f"dtype {run.dtype} != {dtype}")
        if layout is not None and run.layout != layout:
            raise FetchFailed(FetchOutcome.LAYOUT_MISMATCH, f"layout {run.layout} != {layout}")


_NO_NIXL_RETRY_S = 60.0
"""A peer that answered it has no NIXL agent is fetched from over HTTP for this long."""


_LEASE_CLOCK_MARGIN = 0.05
"""Share of a lease's life not trusted: monotonic clocks of two hosts tick at rates within
parts per million of each other; this leaves room for far worse."""


_MAX_CONTROL_BYTES = 64 << 20
"""Largest lease answer: descriptors and hashes of a run of `max_bytes`, JSON."""


class _NoNixl(Exception):
    """The peer serves T2 over HTTP only."""


@dataclass(frozen=True, slots=True)
class _Lease:
    lease_id: str
    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    layout: tuple[int, int, int]
    bytes_per_block: int
    agent: str
    metadata: bytes | None
    pools: tuple[PoolGeometry, ...]
    slots: tuple[tuple[int, int], ...]
    ttl_s: float


def _error_code(answer: Any) -> str | None:
    error = answer.get("error") if isinstance(answer, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _parse_lease(raw: Any) -> _Lease:
    """The lease answer, well-formed (FetchFailed `protocol` otherwise)."""
    try:
        if not isinstance(raw, dict):
            raise ValueError("lease answer must be a JSON object")
        slots = tuple((int(p), int(s)) for p, s in raw["slots"])
        hashes = tuple(bytes.fromhex(h) for h in raw["block_hashes"])
        if len(slots) != len(hashes) or not all(type(p) is int and type(s) is int
                                                 for p, s in raw["slots"]):
            raise ValueError("one slot per block")
        metadata = raw.get("metadata")
        lease_id, agent = raw["lease"], raw["agent"]
        if not float(raw["ttl_s"]) > 0:
            raise ValueError("a lease lives > 0 s")
        if not isinstance(lease_id, str) or not isinstance(agent, str):
            raise ValueError("lease and agent must be strings")
        return _Lease(
            lease_id, int(raw["start_block"]), hashes, str(raw["dtype"]), _layout(raw["layout"]),
            int(raw["bytes_per_block"]), agent,
            base64.b64decode(metadata, validate=True) if metadata is not None else None,
            tuple(PoolGeometry.from_json(g) for g in raw["pools"]), slots,
            float(raw["ttl_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise FetchFailed(FetchOutcome.PROTOCOL, repr(exc)) from exc


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(slots=True, frozen=True)
class _Header:
    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    layout: tuple[int, int, int]
    bytes_per_block: int
    order: WireOrder


async def _read_header(reader: BodyReader, max_bytes: int) -> _Header:
    """The 200 body's preamble and header, consistent in itself (bytes per block from dtype and
    layout, the block count, at most `max_bytes`); FetchFailed otherwise."""
    try:
        magic, version, header_len = PREAMBLE.unpack(await reader.exactly(PREAMBLE.size))
        if magic != MAGIC or version != VERSION or header_len > MAX_HEADER_BYTES:
            raise FetchFailed(FetchOutcome.PROTOCOL, f"bad preamble {magic!r} v{version}")
        raw = json.loads(await reader.exactly(header_len))
        hashes = tuple(bytes.fromhex(h) for h in raw["block_hashes"])
        dtype = str(raw["dtype"])
        layers, heads, head_dim = _layout(raw["layout"])
        bytes_per_block = int(raw["bytes_per_block"])
        element_bytes = _DTYPE_BYTES.get(dtype)
        if element_bytes is None or bytes_per_block != (
            2 * layers * heads * BLOCK_SIZE * head_dim * element_bytes
        ):
            raise FetchFailed(FetchOutcome.PROTOCOL,
                              f"{bytes_per_block} bytes per block of {dtype}")
        n = len(hashes)
        if n != int(raw["num_blocks"]) or not 0 < n * bytes_per_block <= max_bytes:
            raise FetchFailed(FetchOutcome.TOO_LARGE, f"{n} blocks of {bytes_per_block} bytes")
        # A header without the field is a server's from before it: canonical rows.
        order = WireOrder(raw.get("order", WireOrder.CANONICAL.value))
        return _Header(int(raw["start_block"]), hashes, dtype, (layers, heads, head_dim),
                       bytes_per_block, order)
    except asyncio.IncompleteReadError as exc:
        raise FetchFailed(FetchOutcome.SHORT_READ,
                          f"{len(exc.partial)} of {exc.expected} bytes") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise FetchFailed(FetchOutcome.PROTOCOL, repr(exc)) from exc


def _block_bytes(dtype: str, layout: tuple[int, int, int]) -> int:
    layers, heads, head_dim = layout
    return 2 * layers * heads * BLOCK_SIZE * head_dim * _DTYPE_BYTES[dtype]


def _layout(raw: Any) -> tuple[int, int, int]:
    if not isinstance(raw, list) or len(raw) != 3 or not all(type(x) is int and x > 0 for x in raw):
        raise ValueError(f"layout must be 3 positive integers, got {raw!r}")
    return (raw[0], raw[1], raw[2])


def _buffer_landing(run: FetchedRun, bytes_per_block: int) -> Landing:
    """Blocks land in the run's canonical K and V buffers, each row at its strided place."""
    layers, heads, _ = run.layout
    num_rows = layers * heads
    row_per_block = bytes_per_block // (2 * num_rows)
    row_stride = run.capacity_blocks * row_per_block

    def landing(lo: int, hi: int) -> list[memoryview]:
        a, b = lo * row_per_block, hi * row_per_block
        return [buf[row * row_stride + a : row * row_stride + b]
                for buf in (run.k, run.v) for row in range(num_rows)]

    return landing


async def _read_chunks(
    reader: BodyReader, num_blocks: int, bytes_per_block: int, landing: Landing
) -> tuple[int, FetchFailed | None]:
    """Read chunks into place; returns (blocks verified from the start, why it stopped early).

    A chunk's rows are received straight into the views `landing` gives (scatter reads: a few
    large socket reads per chunk, no staging copy); a worker thread checksums the chunk's rows
    where they landed while the next chunk arrives. A chunk that fails its checksum is not
    counted as verified, nor is any chunk after it, so their bytes are never used."""
    checks: list[tuple[asyncio.Future[int], int, int]] = []
    failure: FetchFailed | None = None
    try:
        lo = 0
        while True:
            (n,) = U32.unpack(await reader.exactly(U32.size))
            if n == 0:
                break
            if lo + n > num_blocks:
                raise FetchFailed(FetchOutcome.PROTOCOL, f"chunk of {n} blocks at block {lo}")
            views = landing(lo, lo + n)
            # The caller's landing must match the checked header exactly (no byte off its map).
            if sum(len(view) for view in views) != n * bytes_per_block:
                raise FetchFailed(FetchOutcome.PROTOCOL, f"landing of {n} blocks, wrong size")
            await reader.into_all(views)
            (expected,) = U64.unpack(await reader.exactly(U64.size))
            check = asyncio.ensure_future(asyncio.to_thread(chunk_checksum, views, lo))
            checks.append((check, expected, n))
            lo += n
    except asyncio.IncompleteReadError as exc:
        failure = FetchFailed(FetchOutcome.SHORT_READ,
                              f"{len(exc.partial)} of {exc.expected} bytes")
    except FetchFailed as exc:
        failure = exc
    finally:
        # Every worker finishes before the run is handed on (or its memory reused).
        await asyncio.gather(*(c for c, _, _ in checks), return_exceptions=True)
    verified = 0
    for checksum, expected, n in checks:
        if failure is not None and failure.outcome is FetchOutcome.CHECKSUM:
            continue
        if await checksum != expected:
            failure = FetchFailed(FetchOutcome.CHECKSUM, f"chunk at block {verified}")
            continue
        verified += n
    return verified, failure
