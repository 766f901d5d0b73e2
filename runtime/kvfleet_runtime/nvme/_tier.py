"""`NvmeTier`: the T3 store attached to a replica's `PrefixCache`.

    tier = NvmeTier(cache, store, mode="shadow", registry=registry)   # attaches the eviction sink
    tier.start()                                                       # the background writer
    n = tier.fill(key, token_ids)      # on a local miss (in a thread): blocks imported from T3
    tier.invalidate(weights_digest)    # POST /cache/invalidate (with the cache's own, see there)

Admission is T3's own: of what the host tier evicts (`PrefixCache.set_eviction_sink`), only
blocks the policy still values are kept, i.e. seen at least `min_sightings` times (a one-shot
prompt that fell out of T1 is not worth an NVMe write). Writes happen on one background thread
from a queue bounded in bytes; a full queue drops the newest offer (counted), never blocks the
request path or the cache lock.

Modes (the fleet config's `tiers.nvme` / `tiers.nvme_shadow`, applied live by `set_mode`):

- "on": store and serve. `fill` reads the continuation of the locally held prefix from T3 and
  imports it into the cache (then the engine's own lookup hits).
- "shadow": store and read back exactly as "on" would, then discard what was read; the achieved
  read bandwidth per concurrency level is what the operator compares with the break-even (R6).
- "off": nothing is offered or read, and the store forgets what it held (its blocks become
  unreachable at once; the file keeps its size).

Every failure is a 0 from `fill`: the engine prefills what is missing, as without T3.

`invalidate(weights_digest)` makes T3's blocks of that version unreachable at once (the store's
epoch refuses queued and in-flight writes of it) and keeps a `fill` that read them before from
importing them afterwards: the epoch check and the import happen under one lock the invalidation
takes too. Calling it before and after `PrefixCache.invalidate` (as the replica does) also drops
what T1 evicted into T3 while the cache was being invalidated.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    BlockEvent,
    BlockHash,
    CacheKey,
    EvictedRun,
    PrefixCache,
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
    num_blocks_served: int = 0
    """Blocks read from T3 and imported into the cache (mode "on")."""
    num_blocks_shadow_read: int = 0
    """Blocks read back and discarded (mode "shadow")."""


class _Held:
    """Chain hashes the cache holds, from its events (a lookup would count in the hit stats)."""

    def __init__(self) -> None:
        self._held: set[bytes] = set()
        self._lock = threading.Lock()

    def on_event(self, event: BlockEvent) -> None:
        with self._lock:
            if event.kind == "stored":
                self._held.update(event.block_hashes)
            else:
                self._held.difference_update(event.block_hashes)

    def leading(self, chain: Sequence[bytes]) -> int:
        with self._lock:
            for i, h in enumerate(chain):
                if h not in self._held:
                    return i
        return len(chain)


class NvmeTier:
    def __init__(
        self,
        cache: PrefixCache,
        store: NvmeStore,
        *,
        mode: NvmeMode = "on",
        min_sightings: int = 2,
        max_pending_bytes: int = 256 << 20,
        max_fill_blocks: int = 4096,
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
        self.held = _Held()
        self._pending: queue.Queue[
            tuple[str, int, tuple[BlockHash, ...], memoryview] | None
        ] = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._import_lock = threading.Lock()
        """Held by a fill from its epoch check to the end of its import, and by `invalidate`."""
        self._local = threading.local()
        self._writer: threading.Thread | None = None
        cache.add_listener(self.held.on_event)
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
        """Wait until every queued write has been carried out (tests, shutdown)."""
        self._pending.join()

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

    # -- reads -----------------------------------------------------------------------------

    def fill(self, key: CacheKey, token_ids: Sequence[int]) -> int:
        """Read from T3 what follows the locally held prefix of `token_ids`' full blocks; in
        mode "on" import it and return the blocks imported, in "shadow" discard it (0)."""
        mode = self.mode
        if mode == "off":
            return 0
        try:
            chain = self.cache.block_hashes(key, token_ids)
            local = self.held.leading(chain)
            rest = chain[local : local + self.max_fill_blocks]
            if not rest or not self.store.leading(rest[:1]):
                return 0
            epoch = self.store.epoch(key.weights_digest)
            n_bytes = self.store.block_bytes
            buf = self._buffer(len(rest) * n_bytes)
            got = self.store.read_into(rest, buf)
            with self._lock:
                self.stats.num_fills += 1
                if mode == "shadow":
                    self.stats.num_blocks_shadow_read += got
            if got == 0 or mode == "shadow":
                return 0
            k, v = self._from_block_major(buf, got)
            if local:
                prefix = self.cache.read_blocks(chain[:local], device="cpu")
                if prefix is None:  # evicted meanwhile: the engine prefills, nothing imported
                    return 0
                k = torch.cat([prefix[0], k], dim=2)
                v = torch.cat([prefix[1], v], dim=2)
            end = (local + got) * BLOCK_SIZE
            with self._import_lock:
                if self.store.epoch(key.weights_digest) != epoch:
                    return 0  # invalidated while we read: what we read is of a withdrawn version
                self.cache.import_blocks(key, token_ids[:end], k, v)
            with self._lock:
                self.stats.num_blocks_served += got
            return got
        except Exception:  # T3 never fails a request: the engine prefills instead
            log.exception("T3 fill failed; recomputing")
            return 0

    def _buffer(self, size: int) -> memoryview:
        """This thread's aligned read buffer (reused; O_DIRECT reads land in it directly)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = aligned_buffer(max(size, 1 << 20))
            self._local.buf = buf
        return memoryview(buf)[:size]

    def _from_block_major(self, buf: memoryview, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self.cache.layout
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n * self.store.block_bytes)
        blocks = raw.view(self.cache.dtype).view(
            n, 2, layout.num_layers, layout.num_kv_heads, BLOCK_SIZE, layout.head_dim
        )
        shape = (layout.num_layers, layout.num_kv_heads, n * BLOCK_SIZE, layout.head_dim)
        # [n, L, H, 16, D] -> [L, H, n, 16, D] -> [L, H, n*16, D]: a copy, off the reused buffer.
        k = blocks[:, 0].permute(1, 2, 0, 3, 4).reshape(shape).clone()
        v = blocks[:, 1].permute(1, 2, 0, 3, 4).reshape(shape).clone()
        return k, v

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
