"""`NvmeTier`: the T3 store attached to a replica's `PrefixCache`.

    tier = NvmeTier(cache, store, mode="shadow", registry=registry)   # attaches the eviction sink
    tier.start()                                                       # the background writer
    Engine(..., lower_tiers=[tier, ...])   # a `LowerTier`: asked by the engine's prepare
    tier.invalidate(weights_digest)    # POST /cache/invalidate (with the cache's own, see there)

Admission is T3's own: of what the host tier evicts (`PrefixCache.set_eviction_sink`), only
blocks the policy still values are kept, i.e. seen at least `min_sightings` times (a one-shot
prompt that fell out of T1 is not worth an NVMe write). Writes happen on one background thread
from a queue bounded in bytes; a full queue drops the newest offer (counted), never blocks the
request path or the cache lock.

Modes (the fleet config's `tiers.nvme` / `tiers.nvme_shadow`, applied live by `set_mode`):

- "on": store and serve. The engine's prepare asks T3 (`num_matched`: the store's in-memory
  index, no I/O) how many blocks after what T0 and T1 supply it holds, and T3 reads them on a
  worker thread straight into the engine's blocks (`load_into`: one read per stretch of slots,
  one copy per run of blocks into the engine's layout); the prompt's store at its first token
  then caches them like computed blocks.
- "shadow": store and read back exactly as "on" would, then discard what was read (supplying
  nothing: `num_matched` answers 0 and starts the read on a worker thread); the achieved read
  bandwidth per concurrency level is what the operator compares with the break-even (R6).
- "off": nothing is offered or read, and the store forgets what it held (its blocks become
  unreachable at once; the file keeps its size).

Every failure is a `done(0)` (or fewer leading blocks): the engine prefills what is missing, as
without T3.

`invalidate(weights_digest)` makes T3's blocks of that version unreachable at once (the store's
epoch refuses queued and in-flight writes of it) and keeps a load that read them before from
landing them afterwards: the epoch check and the copy into the engine's blocks happen under one
lock the invalidation takes too. Calling it before and after `PrefixCache.invalidate` (as the
replica does) also drops what T1 evicted into T3 while the cache was being invalidated.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    BlockHash,
    EvictedRun,
    LoadTarget,
    PrefixCache,
    TierQuery,
    paired_runs,
)
from kvfleet_runtime.nvme._store import MODES, NvmeMode, NvmeStore, _runs, aligned_buffer

__all__ = ["NvmeCollector", "NvmeTier", "NvmeTierStats"]

log = logging.getLogger(__name__)

@dataclass(slots=True)
class NvmeTierStats:
    num_blocks_offered: int = 0
    """Blocks the host tier evicted while T3 was on or shadowing."""
    num_blocks_refused: int = 0
    """Offered blocks seen fewer than `min_sightings` times: not written."""
    num_blocks_dropped: int = 0
    """Admitted blocks dropped because the write queue was full."""
    num_fills: int = 0
    """Reads started (loads, and shadow reads)."""
    num_blocks_served: int = 0
    """Blocks read from T3 and landed in the engine's blocks (mode "on")."""
    num_blocks_shadow_read: int = 0
    """Blocks read back and discarded (mode "shadow")."""


class NvmeTier:
    """T3 as a tier below the cache (`kvfleet_runtime.cache.LowerTier`), and the writer of what
    the host tier evicts."""

    name = "t3"

    def __init__(
        self,
        cache: PrefixCache,
        store: NvmeStore,
        *,
        mode: NvmeMode = "on",
        min_sightings: int = 2,
        max_pending_bytes: int = 256 << 20,
        max_fill_blocks: int = 4096,
        max_concurrent_reads: int = 2,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"NVMe mode must be one of {MODES}, got {mode!r}")
        if store.block_bytes != cache.layout.bytes_per_block:
            raise ValueError(
                f"the T3 store's block_bytes {store.block_bytes} is not the cache's "
                f"{cache.layout.bytes_per_block}"
            )
        self.cache = cache
        self.store = store
        self.mode: NvmeMode = mode
        self.min_sightings = min_sightings
        self.max_pending_bytes = max_pending_bytes
        self.max_fill_blocks = max_fill_blocks
        self.stats = NvmeTierStats()
        self._readers = ThreadPoolExecutor(max_concurrent_reads,
                                           thread_name_prefix="kvfleet-t3-read")
        self._reads: set[Future[None]] = set()
        self._pending: queue.Queue[
            tuple[str, int, tuple[BlockHash, ...], memoryview] | None
        ] = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._import_lock = threading.Lock()
        """Held by a load from its epoch check to the end of its copy into the engine's blocks,
        and by `invalidate`."""
        self._local = threading.local()
        self._writer: threading.Thread | None = None
        # Attached only while T3 is on or shadowing: off, evictions cost no copy at all.
        cache.set_eviction_sink(self.offer if mode != "off" else None)
        if registry is not None:
            registry.register(NvmeCollector(self))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_loop, name="kvfleet-t3-writer", daemon=True
            )
            self._writer.start()

    def close(self) -> None:
        self.cache.set_eviction_sink(None)
        self._readers.shutdown(wait=True)
        if self._writer is not None:
            self._pending.put(None)
            self._writer.join(timeout=30)
            self._writer = None
        self.store.close()

    def set_mode(self, mode: NvmeMode) -> None:
        """Apply a toggle live. Off forgets everything T3 held (unreachable at once)."""
        if mode not in MODES:
            raise ValueError(f"NVMe mode must be one of {MODES}, got {mode!r}")
        if mode == self.mode:
            return
        log.info("T3 (NVMe) mode %s -> %s", self.mode, mode)
        self.mode = mode
        self.cache.set_eviction_sink(self.offer if mode != "off" else None)
        if mode == "off":
            self.store.forget_all()

    def invalidate(self, weights_digest: str) -> int:
        """Forget T3's blocks of a weights version (see the module docstring); returns how many
        the store unindexed."""
        with self._import_lock:
            return self.store.invalidate(weights_digest)

    def flush(self) -> None:
        """Wait until every queued write and every read started has been carried out (tests,
        shutdown)."""
        self._pending.join()
        with self._lock:
            reads = list(self._reads)
        for read in reads:
            read.exception()  # waits; a read never raises (it reports through `done`)

    # -- writes ----------------------------------------------------------------------------

    def offer(self, run: EvictedRun) -> None:
        """Eviction sink: queue the blocks of `run` the policy still values."""
        if self.mode == "off":
            return
        n = len(run.block_hashes)
        keep = [i for i, s in enumerate(run.sightings) if s >= self.min_sightings]
        with self._lock:
            self.stats.num_blocks_offered += n
            self.stats.num_blocks_refused += n - len(keep)
        if not keep:
            return
        digest = run.key.weights_digest
        epoch = self.store.epoch(digest)
        # In page-aligned memory under O_DIRECT, so that the store writes it without a copy.
        data = _block_major(run.k, run.v, aligned=self.store.direct)
        per_block = data.shape[1]
        for lo, hi in _runs(keep):
            size = (hi - lo) * per_block
            with self._lock:
                if self._pending_bytes + size > self.max_pending_bytes:
                    self.stats.num_blocks_dropped += hi - lo
                    continue
                self._pending_bytes += size
            view = data[lo:hi].numpy().data.cast("B")
            self._pending.put((digest, epoch, run.block_hashes[lo:hi], view))

    def _write_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                digest, epoch, hashes, view = item
                if self.mode != "off":
                    self.store.put(digest, hashes, view, epoch=epoch)
                with self._lock:
                    self._pending_bytes -= len(view)
            except Exception:  # the writer never dies: a failed write is a block not stored
                log.exception("T3 writer: write failed")
            finally:
                self._pending.task_done()

    # -- reads: the tier below the cache ---------------------------------------------------

    def num_matched(self, query: TierQuery) -> int | None:
        """Blocks after `query.start_block` the store holds, from its in-memory index (no I/O):
        what a load will read. In shadow mode 0 (nothing is supplied) and the read that "on"
        would make starts on a worker thread, to be measured and discarded."""
        mode = self.mode
        if mode == "off":
            return 0
        start = query.start_block
        rest = query.chain[start : start + self.max_fill_blocks]
        n = self.store.leading(rest) if rest else 0
        if n and mode == "shadow":
            self._read_async(lambda: self._shadow_read(list(rest[:n])))
            return 0
        return n

    def load_into(self, query: TierQuery, target: LoadTarget,
                  done: Callable[[int], None]) -> None:
        """Read the matched blocks on a worker thread, straight into the engine's blocks;
        `done(n)`: the leading blocks read, verified and landed (0 on any failure)."""
        try:
            self._read_async(lambda: self._load(query, target, done))
        except Exception:  # shut down: nothing lands
            done(0)

    def forget(self, query: TierQuery) -> None:
        """Nothing to drop: a read keeps no state past its `done`."""

    def _read_async(self, read: Callable[[], None]) -> None:
        future = self._readers.submit(read)
        with self._lock:
            self._reads.add(future)
        future.add_done_callback(self._read_done)

    def _read_done(self, future: Future[None]) -> None:
        with self._lock:
            self._reads.discard(future)

    def _shadow_read(self, hashes: list[BlockHash]) -> None:
        try:
            buf = self._buffer(len(hashes) * self.store.block_bytes)
            got = self.store.read_into(hashes, buf)
            with self._lock:
                self.stats.num_fills += 1
                self.stats.num_blocks_shadow_read += got
        except Exception:
            log.exception("T3 shadow read failed")

    def _load(self, query: TierQuery, target: LoadTarget, done: Callable[[int], None]) -> None:
        landed = 0
        try:
            n = len(target.block_ids)
            start = query.start_block
            hashes = list(query.chain[start : start + n])
            epoch = self.store.epoch(query.key.weights_digest)
            buf = self._buffer(n * self.store.block_bytes)
            got = self.store.read_into(hashes, buf)
            with self._lock:
                self.stats.num_fills += 1
            if got and self.mode == "on":
                with self._import_lock:
                    # Invalidated while we read: what we read is of a withdrawn version.
                    if self.store.epoch(query.key.weights_digest) == epoch:
                        self._land(buf, got, target)
                        landed = got
            with self._lock:
                self.stats.num_blocks_served += landed
        except Exception:  # T3 never fails a request: the engine prefills instead
            log.exception("T3 load failed; recomputing")
            landed = 0
        done(landed)

    def _land(self, buf: memoryview, n: int, target: LoadTarget) -> None:
        """Blocks 0..n of `buf` (block-major: each block's K then V, canonical) into the
        engine's blocks `target.block_ids[:n]`, one copy per run of consecutive ids."""
        layout = self.cache.layout
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n * self.store.block_bytes)
        blocks = raw.view(self.cache.dtype).view(
            n, 2, layout.num_layers, layout.num_kv_heads, BLOCK_SIZE, layout.head_dim
        )
        kv = target.kv
        for dst, src, m in paired_runs(target.block_ids[:n], range(n)):
            run = blocks[src : src + m].permute(1, 2, 0, 3, 4, 5)  # [K|V, L, m, H, 16, D]
            if kv.kv is not None:
                kv.kv[:, :, dst : dst + m].copy_(run)
            else:
                kv.k[:, dst : dst + m].copy_(run[0])
                kv.v[:, dst : dst + m].copy_(run[1])

    def _buffer(self, size: int) -> memoryview:
        """This thread's aligned read buffer (reused; O_DIRECT reads land in it directly)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = aligned_buffer(max(size, 1 << 20))
            self._local.buf = buf
        return memoryview(buf)[:size]

    # -- reports ---------------------------------------------------------------------------

    def report(self) -> dict[str, object]:
        """What the load report carries for the operator: mode, store counters, and the
        achieved read bandwidth per concurrency level (GB/s, all reads at that level together)."""
        store = self.store
        with self._lock:
            stats = dict(vars_of(self.stats))
        return {
            "mode": self.mode,
            "direct_io": store.direct,
            "capacity_blocks": store.num_slots,
            "blocks": len(store),
            "tier": stats,
            "store": dict(vars_of(store.stats)),
            "read_bandwidth": {str(k): v for k, v in store.bandwidth.snapshot().items()},
        }


def vars_of(record: object) -> Iterator[tuple[str, object]]:
    for name in getattr(record, "__slots__", ()):
        yield name, getattr(record, name)


def _block_major(k: torch.Tensor, v: torch.Tensor, *, aligned: bool = False) -> torch.Tensor:
    """`[L, H, n*16, D]` K and V -> uint8 `[n, block_bytes]`: each block's K then V, canonical.
    `aligned`: in a page-aligned buffer (what O_DIRECT writes from without a staging copy)."""
    layers, heads, tokens, head_dim = k.shape
    n = tokens // BLOCK_SIZE
    kb = k.reshape(layers, heads, n, BLOCK_SIZE, head_dim).permute(2, 0, 1, 3, 4)
    vb = v.reshape(layers, heads, n, BLOCK_SIZE, head_dim).permute(2, 0, 1, 3, 4)
    shape = (n, 2, layers, heads, BLOCK_SIZE, head_dim)
    if not aligned:
        data = torch.stack([kb, vb], dim=1).contiguous()  # [n, 2, L, H, 16, D]
        return data.view(torch.uint8).reshape(n, -1)
    num_bytes = 2 * k.numel() * k.element_size()
    # The tensor keeps the mmap alive (frombuffer holds a reference to its buffer).
    raw = torch.frombuffer(aligned_buffer(num_bytes), dtype=torch.uint8, count=num_bytes)
    out = raw.view(k.dtype).view(shape)
    out[:, 0].copy_(kb)
    out[:, 1].copy_(vb)
    return raw.view(n, -1)



class NvmeCollector(Collector):
    """Prometheus view of T3, built at scrape time (nothing on the I/O path)."""

    def __init__(self, tier: NvmeTier, prefix: str = "kvfleet_nvme") -> None:
        self._tier = tier
        self._prefix = prefix

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        tier, p = self._tier, self._prefix
        store = tier.store
        mode = GaugeMetricFamily(f"{p}_mode", "T3 mode (1 for the current one).", labels=["mode"])
        for m in MODES:
            mode.add_metric([m], 1.0 if tier.mode == m else 0.0)
        yield mode
        yield GaugeMetricFamily(f"{p}_blocks", "Blocks held in T3.", value=len(store))
        yield GaugeMetricFamily(
            f"{p}_capacity_blocks", "T3 capacity in blocks.", value=store.num_slots
        )
        for name, value, doc in (
            ("blocks_offered", tier.stats.num_blocks_offered, "Blocks T1 evicted, offered."),
            ("blocks_refused", tier.stats.num_blocks_refused, "Offered blocks not valued."),
            ("blocks_dropped", tier.stats.num_blocks_dropped, "Writes dropped, queue full."),
            ("blocks_served", tier.stats.num_blocks_served, "Blocks served from T3."),
            (
                "blocks_shadow_read",
                tier.stats.num_blocks_shadow_read,
                "Blocks read back and discarded (shadow mode).",
            ),
            ("blocks_written", store.stats.num_blocks_written, "Blocks written to the file."),
            ("bytes_read", store.stats.num_bytes_read, "Bytes read and verified."),
            ("read_errors", store.stats.num_read_errors, "Failed reads (recomputed)."),
            ("write_errors", store.stats.num_write_errors, "Failed writes (not stored)."),
            ("corrupt_blocks", store.stats.num_corrupt, "Checksum mismatches (recomputed)."),
            (
                "invalidated_blocks",
                store.stats.num_invalidated,
                "Blocks dropped because their weights version was invalidated.",
            ),
        ):
            yield CounterMetricFamily(f"{p}_{name}", doc, value=value)
        rec = store.bandwidth
        hist = HistogramMetricFamily(
            f"{p}_read_bandwidth_gb_s",
            "Achieved GB/s of each T3 read, by reads in flight when it started.",
            labels=["concurrency"],
        )
        for level in sorted(rec.counts):
            cumulative, buckets = 0, []
            for edge, count in zip((*rec.edges_gb_s, float("inf")), rec.counts[level], strict=True):
                cumulative += count
                buckets.append(("+Inf" if edge == float("inf") else str(edge), cumulative))
            hist.add_metric([str(level)], buckets, sum_value=rec.sum_gb_s[level])
        yield hist
