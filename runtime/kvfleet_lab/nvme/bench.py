"""`kvfleet bench nvme --path DIR`: the T3 store's achieved bandwidth on a path, beside raw
sequential I/O of the same bytes, and the verdict against the reference model's break-even.

What is compared, at each concurrency level (1, 4, 8 by default):

- store: `NvmeStore.put` of runs of blocks (each run one pwritev), then `NvmeStore.read_into` of
  the same runs (one preadv per run plus an xxh3 checksum per block and the index look-ups),
  `concurrency` threads at once, each reading its share of the runs;
- raw: plain `pwritev`/`preadv` of the same bytes, in the same run sizes, with the same open
  mode, by the same number of threads: what `fio` with `--rw=read --bs=<run>
  --numjobs=<concurrency>` would measure, without its installation.

Both sides work on the SAME file: raw reads each run at the slots where the store put it
(`NvmeStore.slot_of`), and raw writes put the payload the store writes at the same offsets (every
run carries the same payload, so the store's checksums stay valid). Reps alternate which side goes
first, so a device that drifts (a shared disk, a cloud volume's burst credits) drifts over both
sides alike; every figure is the median of `reps` passes per side and the ratio is the ratio of
the medians (the per-pass figures are in the JSON). With O_DIRECT no page cache is involved; in
buffered mode each write pass ends with an `fdatasync` and each read pass starts with the file's
page cache dropped (`POSIX_FADV_DONTNEED`), on both sides, so both measure the device.

Blocks are the reference model's (70B, 80 layers, GQA-8, head_dim 128, FP16 KV: 16 tokens x
320 KiB = 5 MiB). The verdict uses the break-even arithmetic (`kvfleet_runtime.breakeven`) for
that model on H100 at TP4, with FP16 KV (9.26 GB/s) and FP8 KV (4.63 GB/s): above it T3 helps
latency; below it, it can still help capacity for a batch fleet (R1).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_runtime.breakeven import (
    DEFAULT_BATCH_SLACK,
    GPUS,
    MODELS,
    KVDtype,
    Medium,
    break_even_bandwidth,
    judge_tier,
    kv_bytes_per_token,
    recompute_s_per_token,
)
from kvfleet_runtime.nvme import NvmeConfig, NvmeStore, aligned_buffer
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = ["NvmeBenchReport", "run_nvme_bench"]

TARGET_RATIO = 0.7
PREFIX_TOKENS = 2000


@dataclass(slots=True)
class LevelFigures:
    concurrency: int
    store_read_gb_s: float
    """Median over the reps (as are the three below)."""
    raw_read_gb_s: float
    store_write_gb_s: float
    raw_write_gb_s: float
    store_read_reps_gb_s: list[float] = field(default_factory=list)
    """Each pass, in the order run (store and raw passes alternate)."""
    raw_read_reps_gb_s: list[float] = field(default_factory=list)
    store_write_reps_gb_s: list[float] = field(default_factory=list)
    raw_write_reps_gb_s: list[float] = field(default_factory=list)

    @property
    def read_ratio(self) -> float:
        return self.store_read_gb_s / self.raw_read_gb_s if self.raw_read_gb_s else 0.0

    @property
    def write_ratio(self) -> float:
        return self.store_write_gb_s / self.raw_write_gb_s if self.raw_write_gb_s else 0.0


@dataclass(slots=True)
class Verdict:
    kv_dtype: str
    break_even_gb_s: float
    measured_gb_s: float
    at_concurrency: int
    margin: float
    verdict: str
    """"build" (beats the break-even: helps latency), "batch_only" (a capacity win for a batch
    fleet, R1) or "never"."""


@dataclass(slots=True)
class NvmeBenchReport:
    path: str
    direct_io: bool
    block_bytes: int
    run_blocks: int
    bytes_per_level: int
    reps: int
    levels: list[LevelFigures] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def min_read_ratio(self) -> float:
        return min((lv.read_ratio for lv in self.levels), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "direct_io": self.direct_io,
            "block_bytes": self.block_bytes,
            "run_blocks": self.run_blocks,
            "bytes_per_level": self.bytes_per_level,
            "reps": self.reps,
            "target_read_ratio": TARGET_RATIO,
            "min_read_ratio": self.min_read_ratio,
            "page_cache": "bypassed (O_DIRECT)" if self.direct_io else "dropped before each read",
            "reads": [
                {
                    "concurrency": lv.concurrency,
                    "store_read_gb_s": lv.store_read_gb_s,
                    "raw_read_gb_s": lv.raw_read_gb_s,
                    "ratio": lv.read_ratio,
                    "store_read_reps_gb_s": lv.store_read_reps_gb_s,
                    "raw_read_reps_gb_s": lv.raw_read_reps_gb_s,
                }
                for lv in self.levels
            ],
            "writes": [
                {
                    "concurrency": lv.concurrency,
                    "store_write_gb_s": lv.store_write_gb_s,
                    "raw_write_gb_s": lv.raw_write_gb_s,
                    "ratio": lv.write_ratio,
                    "store_write_reps_gb_s": lv.store_write_reps_gb_s,
                    "raw_write_reps_gb_s": lv.raw_write_reps_gb_s,
                }
                for lv in self.levels
            ],
            "verdicts": [asdict(v) for v in self.verdicts],
        }


def reference_block_bytes() -> int:
    """K and V of one 16-token block of the reference model at FP16: 5 MiB."""
    return BLOCK_SIZE * kv_bytes_per_token(MODELS["reference-70b"], KVDtype.FP16)


def run_nvme_bench(
    path: Path,
    *,
    concurrency: Sequence[int] = (1, 4, 8),
    size_bytes: int = 512 << 20,
    run_blocks: int = 4,
    block_bytes: int | None = None,
    reps: int = 5,
    direct: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> NvmeBenchReport:
    """Measure; raises ValueError for a path that cannot host the store."""
    block = block_bytes or reference_block_bytes()
    if run_blocks < 1 or reps < 1 or any(c < 1 for c in concurrency) or not concurrency:
        raise ValueError(
            f"run_blocks, reps and every concurrency must be >= 1, got {run_blocks}, {reps}, "
            f"{list(concurrency)}"
        )
    num_runs = max(*concurrency, size_bytes // (run_blocks * block))
    num_blocks = num_runs * run_blocks
    config = NvmeConfig(path, num_blocks * -(-block // 4096) * 4096, block, direct=direct)
    store = NvmeStore.open(config)
    if store is None:
        raise ValueError(
            f"{path}: cannot host a {config.num_slots * config.slot_bytes}-byte T3 store "
            "(missing directory, no permission or not enough space; see the log)"
        )
    # A second fd on the store's own file, opened as the store opened it.
    raw_fd = os.open(store.file, os.O_RDWR | (os.O_DIRECT if store.direct else 0))
    report = NvmeBenchReport(str(path), store.direct, block, run_blocks, num_blocks * block, reps)
    try:
        payload = aligned_buffer(run_blocks * block)
        payload.write(_pattern(len(payload)))
        runs = [[i.to_bytes(16, "big") for i in range(r * run_blocks, (r + 1) * run_blocks)]
                for r in range(num_runs)]
        run_bytes = run_blocks * config.slot_bytes
        if config.slot_bytes != block:
            raise ValueError(f"block_bytes must be a multiple of 4096, got {block}")
        offsets: list[int] = []  # where the store put run r (what raw reads for run r)
        work: dict[tuple[str, str], Callable[[int], None]] = {
            ("store", "write"): lambda r: _store_put(store, runs[r], payload),
            ("raw", "write"): lambda r: _raw_write(raw_fd, r * run_bytes, payload),
            ("store", "read"): lambda r: _store_read(store, runs[r]),
            ("raw", "read"): lambda r: _raw_read(raw_fd, offsets[r], run_bytes),
        }
        total = num_blocks * block

        def passes(phase: str, level: int) -> dict[str, list[float]]:
            gb_s: dict[str, list[float]] = {"store": [], "raw": []}
            for rep in range(reps):
                for side in ("store", "raw") if rep % 2 == 0 else ("raw", "store"):
                    if phase == "write" and side == "store":
                        store.forget_all()  # the store writes only what it does not hold
                    if phase == "read" and not store.direct:
                        _drop_page_cache(raw_fd)
                    seconds = _timed(level, num_runs, clock, work[side, phase],
                                     after=None if store.direct or phase == "read"
                                     else lambda: os.fdatasync(raw_fd))
                    gb_s[side].append(total / seconds / 1e9)
            return gb_s

        for level in concurrency:
            writes = passes("write", level)
            # The store holds every run now (raw writes put the same bytes in the same slots).
            offsets[:] = [_slot_offset(store, run) for run in runs]
            reads = passes("read", level)
            report.levels.append(LevelFigures(
                level,
                statistics.median(reads["store"]), statistics.median(reads["raw"]),
                statistics.median(writes["store"]), statistics.median(writes["raw"]),
                reads["store"], reads["raw"], writes["store"], writes["raw"],
            ))
    finally:
        store.close()
        os.close(raw_fd)
        store.file.unlink(missing_ok=True)
    report.verdicts = _verdicts(report.levels)
    return report


def _pattern(size: int) -> bytes:
    # Incompressible enough that no layer in between can shortcut it, cheap to make.
    chunk = os.urandom(1 << 20)
    return (chunk * (size // len(chunk) + 1))[:size]


def _slot_offset(store: NvmeStore, run: list[bytes]) -> int:
    slot = store.slot_of(run[0])
    if slot is None or any(store.slot_of(h) != slot + i for i, h in enumerate(run)):
        raise ValueError(f"T3 store write failed at {store.file} (see the log)")
    return slot * store.slot_bytes


def _drop_page_cache(fd: int) -> None:
    """Buffered mode: what a read pass finds in memory is not the device's figure."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


_local = threading.local()


def _buffer(size: int) -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < size:
        buf = aligned_buffer(size)
        buf.write(bytes(size))  # touched once: page faults are not what is measured
        _local.buf = buf
    return memoryview(buf)[:size]


def _store_put(store: NvmeStore, hashes: list[bytes], payload: Any) -> None:
    if store.put("sha256:bench", hashes, memoryview(payload)) != len(hashes):
        raise ValueError(f"T3 store write failed at {store.file} (see the log)")


def _store_read(store: NvmeStore, hashes: list[bytes]) -> None:
    if store.read_into(hashes, _buffer(len(hashes) * store.block_bytes)) != len(hashes):
        raise ValueError(f"T3 store read failed at {store.file} (see the log)")


def _raw_write(fd: int, offset: int, payload: Any) -> None:
    if os.pwritev(fd, [payload], offset) != len(payload):
        raise ValueError("short raw write")


def _raw_read(fd: int, offset: int, size: int) -> None:
    if os.preadv(fd, [_buffer(size)], offset) != size:
        raise ValueError("short raw read")


def _timed(level: int, num_runs: int, clock: Callable[[], float],
           work: Callable[[int], None], after: Callable[[], None] | None = None) -> float:
    """Wall seconds for `level` threads to do runs 0..num_runs-1 between them (run r goes to
    thread r % level, so each thread reads sequentially through its share), then `after`."""
    errors: list[BaseException] = []
    start = threading.Barrier(level + 1)

    def worker(i: int) -> None:
        start.wait()
        try:
            for r in range(i, num_runs, level):
                work(r)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(level)]
    for t in threads:
        t.start()
    start.wait()
    t0 = clock()
    for t in threads:
        t.join()
    if after is not None and not errors:
        after()
    seconds = clock() - t0
    if errors:
        raise errors[0]
    return max(seconds, 1e-9)


def _verdicts(levels: Sequence[LevelFigures]) -> list[Verdict]:
    """The reference model (70B) on H100 at TP4, FP16 and FP8 KV, against the store's read
    bandwidth at the highest concurrency measured (the fleet's p95 decides in production)."""
    model, gpu, tp = MODELS["reference-70b"], GPUS["h100"], 4
    top = max(levels, key=lambda lv: lv.concurrency)
    out = []
    for dtype in (KVDtype.FP16, KVDtype.FP8):
        be = break_even_bandwidth(model, dtype, gpu, tp)
        bw = top.store_read_gb_s * 1e9
        prefix_bytes = PREFIX_TOKENS * kv_bytes_per_token(model, dtype)
        recompute = PREFIX_TOKENS * recompute_s_per_token(model, gpu, tp)
        tier = judge_tier(Medium("measured-t3", "T3", bw, "this path, measured"), prefix_bytes,
                          recompute, tp, be, DEFAULT_BATCH_SLACK)
        out.append(Verdict(dtype.value, be / 1e9, top.store_read_gb_s, top.concurrency,
                           tier.margin, tier.verdict.value))
    return out
