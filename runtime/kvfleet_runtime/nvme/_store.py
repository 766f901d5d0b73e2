"""The T3 block store: KV blocks in one preallocated file on a local NVMe path. Pure (no torch).

    store = NvmeStore.open(NvmeConfig(path, capacity_bytes, block_bytes))   # None: unusable path
    store.put(weights_digest, hashes, data)      # data: len(hashes) blocks, block-major bytes
    n = store.read_into(hashes, out)             # leading blocks read AND verified (0: recompute)
    store.invalidate(weights_digest)             # POST /cache/invalidate: unreachable at once

Layout. The file is `num_slots` fixed slots of `slot_bytes` (`block_bytes` rounded up to 4 KiB,
so every I/O is aligned for O_DIRECT). A slot holds one block in the cache's canonical layout: K
`[num_layers, num_kv_heads, 16, head_dim]` then V alike (what `PrefixCache.read_blocks` returns
for one block, K and V side by side). The index (chain hash -> slot, checksum, weights digest) is
in memory only: the file is recreated at every open, because an emptyDir or a local PV outliving
the process would otherwise serve blocks nobody can vouch for.

Placement is a ring (a FIFO log, as flash caches do it): a run of blocks goes to the next
`len(run)` slots after the head, wrapping to slot 0 when it would not fit, and whatever held those
slots is dropped. Writes are therefore one large sequential `pwritev` per run, and a run read back
is one `preadv` per stretch of consecutive slots. What reaches the store is already filtered by
admission (the tier offers only blocks the host tier evicted and the policy still values, see
`_tier.py`), so FIFO order among them is enough.

I/O. O_DIRECT where the filesystem allows it (probed at open with one aligned write and read;
tmpfs and some overlay filesystems refuse it), else buffered with an explicit fsync policy:
`fdatasync` after every `fsync_every_bytes` written, so dirty pages stay bounded instead of
being flushed in one storm by the kernel. Durability is not a goal: nothing survives the process.

Failures never return wrong data and never raise out of `put`/`read_into`: a missing or
unwritable directory, or a disk too small for the file, makes `open` return None (the tier is then
off); a failed or short write leaves the run unindexed; an I/O error, a short read or a checksum
mismatch (xxh3-64 per block) drops the block and returns only the verified leading blocks. A read
racing a write that reuses its slots is caught by re-checking, after the read, that every entry it
read is still the one indexed (the writer unindexes slots before overwriting them).

Invalidation. `invalidate(weights_digest)` unindexes that version's blocks at once (a read in
flight discards them by the same re-check) and frees their slots for the ring. Each call also
advances the version's epoch: a write that began before it is not indexed when it finishes, and a
write queued before it (`put(..., epoch=)` with the epoch read at queueing time) is refused, so no
block of an invalidated version comes back through a write that was already on its way.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import xxhash

__all__ = [
    "ALIGN_BYTES",
    "MODES",
    "STORE_FILENAME",
    "BandwidthRecorder",
    "NvmeConfig",
    "NvmeMode",
    "NvmeStats",
    "NvmeStore",
    "aligned_buffer",
    "concurrency_bucket",
    "mode_for",
]

log = logging.getLogger(__name__)

ALIGN_BYTES = 4096
"""O_DIRECT alignment of offsets, sizes and buffers (the logical block size of NVMe is 512 B or
4 KiB; 4 KiB satisfies both)."""
STORE_FILENAME = "kvfleet-t3.blocks"
NvmeMode = Literal["off", "shadow", "on"]
MODES: tuple[NvmeMode, ...] = ("off", "shadow", "on")
CONCURRENCY_BUCKETS = (1, 2, 4, 8, 16, 32)
"""Reads in flight are reported at these levels (a level counts reads up to it)."""


def mode_for(nvme: bool, shadow: bool) -> NvmeMode:
    """The T3 mode of the fleet config's toggles: serving wins over shadowing (both measure)."""
    return "on" if nvme else ("shadow" if shadow else "off")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def aligned_buffer(num_bytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer (what O_DIRECT needs for its user memory)."""
    return mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def concurrency_bucket(in_flight: int) -> int:
    """The reported level of `in_flight` concurrent reads: the smallest bucket holding it."""
    for level in CONCURRENCY_BUCKETS:
        if in_flight <= level:
            return level
    return CONCURRENCY_BUCKETS[-1]


@dataclass(slots=True, frozen=True)
class NvmeConfig:
    path: Path
    """Directory of the store file (the chart mounts an emptyDir or a local PV here)."""
    capacity_bytes: int
    """The file never grows beyond this (rounded down to whole slots)."""
    block_bytes: int
    """K and V of one block (`KVLayout.bytes_per_block`)."""
    direct: bool | None = None
    """O_DIRECT: None = when the filesystem allows it; False = buffered; True = required (open
    returns None if the filesystem refuses it)."""
    fsync_every_bytes: int = 256 << 20
    """Buffered mode: fdatasync after this many bytes written (0: leave it to the kernel)."""
    max_io_bytes: int = 64 << 20
    """Largest single pwritev/preadv; longer runs are split (a bounded staging buffer)."""

    def __post_init__(self) -> None:
        if self.block_bytes <= 0:
            raise ValueError(f"NvmeConfig.block_bytes must be > 0, got {self.block_bytes}")
        slot = _round_up(self.block_bytes, ALIGN_BYTES)
        if self.capacity_bytes < slot:
            raise ValueError(
                f"NvmeConfig.capacity_bytes must hold at least one {slot}-byte slot, got "
                f"{self.capacity_bytes}"
            )
        if self.fsync_every_bytes < 0:
            raise ValueError(
                f"NvmeConfig.fsync_every_bytes must be >= 0, got {self.fsync_every_bytes}"
            )
        if self.max_io_bytes < slot:
            raise ValueError(
                f"NvmeConfig.max_io_bytes must be >= one slot ({slot} B), got {self.max_io_bytes}"
            )

    @property
    def slot_bytes(self) -> int:
        return _round_up(self.block_bytes, ALIGN_BYTES)

    @property
    def num_slots(self) -> int:
        return self.capacity_bytes // self.slot_bytes


@dataclass(slots=True)
class NvmeStats:
    direct: bool
    num_slots: int
    num_blocks: int = 0
    num_blocks_written: int = 0
    num_bytes_written: int = 0
    num_blocks_read: int = 0
    num_bytes_read: int = 0
    num_evictions: int = 0
    """Blocks overwritten by the ring."""
    num_write_errors: int = 0
    num_read_errors: int = 0
    num_corrupt: int = 0
    """Blocks whose checksum did not match: dropped, recomputed."""
    num_raced: int = 0
    """Blocks whose slot was reused while being read: discarded."""
    num_fsyncs: int = 0
    num_invalidated: int = 0
    """Blocks unindexed by `invalidate` (their weights version was withdrawn)."""
    num_stale_writes: int = 0
    """Blocks of a write that an `invalidate` of their version overtook: not indexed."""


@dataclass(slots=True)
class _Entry:
    slot: int
    checksum: int
    weights_digest: str


@dataclass(slots=True)
class BandwidthRecorder:
    """Achieved read bandwidth per concurrency level: a histogram of GB/s per read and totals.
    Pure; the store feeds it one sample per `read_into`."""

    edges_gb_s: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
    counts: dict[int, list[int]] = field(default_factory=dict)
    """level -> per-bucket counts (len(edges) + 1, the last bucket is +Inf)."""
    num_bytes: dict[int, int] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    sum_gb_s: dict[int, float] = field(default_factory=dict)
    """Sum of the per-read GB/s observed (a histogram's sum)."""

    def record(self, level: int, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        gb_s = num_bytes / seconds / 1e9
        buckets = self.counts.setdefault(level, [0] * (len(self.edges_gb_s) + 1))
        i = next((i for i, e in enumerate(self.edges_gb_s) if gb_s <= e), len(self.edges_gb_s))
        buckets[i] += 1
        self.num_bytes[level] = self.num_bytes.get(level, 0) + num_bytes
        self.seconds[level] = self.seconds.get(level, 0.0) + seconds
        self.sum_gb_s[level] = self.sum_gb_s.get(level, 0.0) + gb_s

    def per_read_gb_s(self, level: int) -> float | None:
        """Bytes over busy seconds of one read at `level` (None: no sample)."""
        s = self.seconds.get(level, 0.0)
        return self.num_bytes[level] / s / 1e9 if s > 0 else None

    def aggregate_gb_s(self, level: int) -> float | None:
        """What `level` concurrent reads deliver together (per-read bandwidth x level)."""
        per = self.per_read_gb_s(level)
        return None if per is None else per * level

    def snapshot(self) -> dict[int, dict[str, float | int]]:
        return {
            level: {
                "num_reads": sum(self.counts[level]),
                "num_bytes": self.num_bytes[level],
                "seconds": self.seconds[level],
                "aggregate_gb_s": self.aggregate_gb_s(level) or 0.0,
            }
            for level in sorted(self.counts)
        }


class NvmeStore:
    """One store file. Thread-safe: reads run concurrently; writes are serialized."""

    def __init__(
        self,
        config: NvmeConfig,
        fd: int,
        direct: bool,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.direct = direct
        self.file = config.path / STORE_FILENAME
        self._fd = fd
        self._clock = clock
        self.num_slots = config.num_slots
        self.slot_bytes = config.slot_bytes
        self.block_bytes = config.block_bytes
        self._index: dict[bytes, _Entry] = {}
        self._owner: list[bytes | None] = [None] * self.num_slots
        self._head = 0
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._unsynced_bytes = 0
        self._in_flight = 0
        self._epochs: dict[str, int] = {}
        """weights digest -> how many times it was invalidated (absent: never)."""
        self._local = threading.local()
        self.stats = NvmeStats(direct=direct, num_slots=self.num_slots)
        self.bandwidth = BandwidthRecorder()
        self.write_bandwidth = BandwidthRecorder()

    # -- open / close ----------------------------------------------------------------------

    @classmethod
    def open(
        cls, config: NvmeConfig, *, clock: Callable[[], float] = time.perf_counter
    ) -> NvmeStore | None:
        """Create the store file (replacing any old one) and preallocate it. None, with the
        reason logged, when the path cannot hold it: the replica then runs without T3."""
        opened = _create(config)
        if isinstance(opened, str):
            log.error("T3 store disabled: %s", opened)
            return None
        fd, direct = opened
        return cls(config, fd, direct, clock=clock)

    def close(self) -> None:
        with self._write_lock, self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._index.clear()
            self._owner = [None] * self.num_slots
            self.stats.num_blocks = 0

    # -- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def epoch(self, weights_digest: str) -> int:
        """The invalidation epoch of a weights version: what a queued write passes to `put`."""
        with self._lock:
            return self._epochs.get(weights_digest, 0)

    def slot_of(self, h: bytes) -> int | None:
        """The slot holding block `h` (None: not held); its bytes start at `slot * slot_bytes`.
        For tools that read what the store holds without it (the bench's raw baseline)."""
        with self._lock:
            entry = self._index.get(h)
        return None if entry is None else entry.slot

    def leading(self, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` the store holds (no I/O)."""
        with self._lock:
            for i, h in enumerate(hashes):
                if h not in self._index:
                    return i
        return len(hashes)

    # -- writes ----------------------------------------------------------------------------

    def put(
        self,
        weights_digest: str,
        hashes: Sequence[bytes],
        data: memoryview | bytes,
        *,
        epoch: int | None = None,
    ) -> int:
        """Write blocks (`data`: `len(hashes) * block_bytes`, block after block) that the store
        does not hold yet; returns the blocks written (0 on any failure, nothing indexed).
        `epoch`: the version's `epoch()` when the write was decided; an `invalidate` since then
        refuses it (0)."""
        n_bytes = self.block_bytes
        view = memoryview(data).cast("B")
        if len(view) != len(hashes) * n_bytes:
            raise ValueError(f"put: data must be {len(hashes)} x {n_bytes} bytes, got {len(view)}")
        written = 0
        with self._write_lock:
            if self._fd < 0:
                return 0
            with self._lock:
                current = self._epochs.get(weights_digest, 0)
                if epoch is not None and epoch != current:
                    self.stats.num_stale_writes += len(hashes)
                    return 0
                todo = [i for i, h in enumerate(hashes) if h not in self._index]
            for lo, hi in _runs(todo):
                per_io = max(1, min(self.config.max_io_bytes // self.slot_bytes, self.num_slots))
                for start in range(lo, hi, per_io):
                    stop = min(hi, start + per_io)
                    written += self._put_run(
                        weights_digest,
                        current,
                        hashes[start:stop],
                        view[start * n_bytes : stop * n_bytes],
                    )
        return written

    def _put_run(
        self, weights_digest: str, epoch: int, hashes: Sequence[bytes], data: memoryview
    ) -> int:
        n = len(hashes)
        slot_bytes, n_bytes = self.slot_bytes, self.block_bytes
        with self._lock:
            if self._head + n > self.num_slots:
                self._head = 0
            first = self._head
            self._head = (first + n) % self.num_slots
            # Unindex before overwriting: a reader of these slots re-checks its entries after
            # reading and discards what it read (see read_into).
            for slot in range(first, first + n):
                old = self._owner[slot]
                if old is not None:
                    self._owner[slot] = None
                    del self._index[old]
                    self.stats.num_evictions += 1
            self.stats.num_blocks = len(self._index)
        size = n * slot_bytes
        checksums = [
            xxhash.xxh3_64_intdigest(data[i * n_bytes : (i + 1) * n_bytes]) for i in range(n)
        ]
        if n_bytes == slot_bytes and (not self.direct or _is_aligned(data)):
            out = data  # slots are the blocks back to back: write the caller's bytes as they are
        else:  # padded slots, or O_DIRECT from unaligned memory: through the aligned staging
            staging = self._staging(size)
            for i in range(n):
                staging[i * slot_bytes : i * slot_bytes + n_bytes] = data[
                    i * n_bytes : (i + 1) * n_bytes
                ]
            out = memoryview(staging)[:size]
        t0 = self._clock()
        try:
            done = os.pwritev(self._fd, [out], first * slot_bytes)
            if done != size:
                raise OSError(errno.EIO, f"short write: {done} of {size} bytes")
            self._unsynced_bytes += size
            every = self.config.fsync_every_bytes
            if not self.direct and every and self._unsynced_bytes >= every:
                os.fdatasync(self._fd)
                self._unsynced_bytes = 0
                self.stats.num_fsyncs += 1
        except OSError as exc:
            log.warning("T3 write of %d blocks failed (%s): not stored", n, exc)
            with self._lock:
                self.stats.num_write_errors += 1
            return 0
        seconds = self._clock() - t0
        with self._lock:
            if self._epochs.get(weights_digest, 0) != epoch:
                # Invalidated while being written: the slots stay free, nothing is reachable.
                self.stats.num_stale_writes += n
                return 0
            for i, h in enumerate(hashes):
                if h in self._index:  # cannot happen with one writer; keep the index exact
                    continue
                slot = first + i
                self._index[h] = _Entry(slot, checksums[i], weights_digest)
                self._owner[slot] = h
            self.stats.num_blocks = len(self._index)
            self.stats.num_blocks_written += n
            self.stats.num_bytes_written += n * n_bytes
            self.write_bandwidth.record(1, n * n_bytes, seconds)
        return n

    # -- reads -----------------------------------------------------------------------------

    def read_into(self, hashes: Sequence[bytes], out: memoryview | bytearray | mmap.mmap) -> int:
        """Read the leading held blocks of `hashes` into `out` (block after block, `block_bytes`
        each; it must hold them all); returns how many were read and verified (0: none)."""
        n_bytes, slot_bytes = self.block_bytes, self.slot_bytes
        target = memoryview(out).cast("B")
        with self._lock:
            entries: list[_Entry] = []
            for h in hashes:
                entry = self._index.get(h)
                if entry is None:
                    break
                entries.append(entry)
            if not entries or self._fd < 0:
                return 0
            if len(target) < len(entries) * n_bytes:
                raise ValueError(
                    f"read_into: out holds {len(target)} bytes, {len(entries)} blocks need "
                    f"{len(entries) * n_bytes}"
                )
            self._in_flight += 1
            level = concurrency_bucket(self._in_flight)
        t0 = self._clock()
        verified = 0
        try:
            direct_ok = n_bytes == slot_bytes and (not self.direct or _is_aligned(target))
            per_io = max(1, self.config.max_io_bytes // slot_bytes)
            for lo, hi in _slot_runs(entries, per_io):
                count = hi - lo
                size = count * slot_bytes
                if direct_ok:
                    buf = target[lo * n_bytes : hi * n_bytes]
                else:
                    buf = memoryview(self._staging(size))[:size]
                got = os.preadv(self._fd, [buf], entries[lo].slot * slot_bytes)
                if got != size:
                    raise OSError(errno.EIO, f"short read: {got} of {size} bytes")
                ok = True
                for i in range(count):
                    block = buf[i * slot_bytes : i * slot_bytes + n_bytes]
                    if xxhash.xxh3_64_intdigest(block) != entries[lo + i].checksum:
                        ok = False
                        self._drop_corrupt(hashes[lo + i], entries[lo + i])
                        break
                    if not direct_ok:
                        target[(lo + i) * n_bytes : (lo + i + 1) * n_bytes] = block
                    verified += 1
                if not ok:
                    break
        except OSError as exc:
            log.warning("T3 read failed (%s): recomputing", exc)
            with self._lock:
                self.stats.num_read_errors += 1
                # The slots may be bad: forget the blocks that failed to read.
                for h, entry in zip(
                    hashes[verified : len(entries)], entries[verified:], strict=False
                ):
                    self._forget(h, entry)
        seconds = self._clock() - t0
        with self._lock:
            self._in_flight -= 1
            # A slot reused while we read it: the writer unindexed it first, so the entry is gone.
            for i in range(verified):
                if self._index.get(hashes[i]) is not entries[i]:
                    self.stats.num_raced += verified - i
                    verified = i
                    break
            self.stats.num_blocks_read += verified
            self.stats.num_bytes_read += verified * n_bytes
            self.bandwidth.record(level, verified * n_bytes, seconds)
        return verified

    def _drop_corrupt(self, h: bytes, entry: _Entry) -> None:
        log.warning("T3 block in slot %d failed its checksum: dropped, recomputing", entry.slot)
        with self._lock:
            self.stats.num_corrupt += 1
            self._forget(h, entry)

    def _forget(self, h: bytes, entry: _Entry) -> None:
        if self._index.get(h) is entry:
            del self._index[h]
            self._owner[entry.slot] = None
            self.stats.num_blocks = len(self._index)

    # -- control ---------------------------------------------------------------------------

    def invalidate(self, weights_digest: str) -> int:
        """Make every block of a weights version unreachable now and free its slots (the ring
        reuses them); writes of that version already on their way are not indexed (see the
        module docstring). Returns the blocks unindexed."""
        with self._lock:
            self._epochs[weights_digest] = self._epochs.get(weights_digest, 0) + 1
            stale = [(h, e) for h, e in self._index.items() if e.weights_digest == weights_digest]
            for h, entry in stale:
                self._forget(h, entry)
            self.stats.num_invalidated += len(stale)
        return len(stale)

    def forget_all(self) -> int:
        """Forget every block (T3 turned off): unreachable at once, slots reused later."""
        with self._lock:
            n = len(self._index)
            self._index.clear()
            self._owner = [None] * self.num_slots
            self.stats.num_blocks = 0
        return n

    def _staging(self, size: int) -> mmap.mmap:
        """This thread's aligned staging buffer of at least `size` bytes (reused: first-touch
        page faults of a fresh buffer cost more than the copy)."""
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = aligned_buffer(_round_up(size, ALIGN_BYTES))
            self._local.buf = buf
        return buf


def _create(config: NvmeConfig) -> tuple[int, bool] | str:
    """(fd, O_DIRECT?) of a fresh, preallocated store file, or why there cannot be one."""
    path = config.path
    if not path.is_dir():
        return f"directory {path} does not exist"
    file = path / STORE_FILENAME
    size = config.num_slots * config.slot_bytes
    try:
        file.unlink(missing_ok=True)
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        return f"cannot create {file}: {exc.strerror or exc}"
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        file.unlink(missing_ok=True)
        return (
            f"cannot preallocate {size} bytes at {file} (capacity_bytes="
            f"{config.capacity_bytes}): {exc.strerror or exc}"
        )
    if config.direct is False:
        return fd, False
    dfd = _open_direct(file)
    if dfd is not None:
        os.close(fd)
        return dfd, True
    if config.direct:
        os.close(fd)
        return f"O_DIRECT was required but the filesystem of {path} refuses it"
    return fd, False


def _open_direct(file: Path) -> int | None:
    """An O_DIRECT fd on `file` if the filesystem honours it (one aligned write and read)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(file, os.O_RDWR | flag)
    except OSError:
        return None
    probe = aligned_buffer(ALIGN_BYTES)
    try:
        if os.pwritev(fd, [probe], 0) != ALIGN_BYTES or os.preadv(fd, [probe], 0) != ALIGN_BYTES:
            raise OSError(errno.EIO, "short probe")
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can read straight into `view` (an mmap-backed or page-aligned buffer is
    what callers pass for zero-copy reads; anything else goes through the staging buffer)."""
    if view.readonly or not view.contiguous:
        return False
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return False
    return address % ALIGN_BYTES == 0


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """[lo, hi) stretches of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _slot_runs(entries: Sequence[_Entry], max_len: int) -> list[tuple[int, int]]:
    """[lo, hi) stretches of `entries` whose slots are consecutive (one preadv each)."""
    runs: list[tuple[int, int]] = []
    for i, entry in enumerate(entries):
        if (
            runs
            and runs[-1][1] == i
            and entries[i - 1].slot + 1 == entry.slot
            and i - runs[-1][0] < max_len
        ):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
