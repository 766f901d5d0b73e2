"""The T3 block store on a real file: layout, ring placement, checksums, and every failure mode
degrading to "fewer blocks" (recompute), never to wrong bytes or an exception."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvfleet_runtime.nvme import (
    ALIGN_BYTES,
    STORE_FILENAME,
    BandwidthRecorder,
    NvmeConfig,
    NvmeStore,
    aligned_buffer,
    concurrency_bucket,
)

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def block(i: int, size: int) -> bytes:
    return bytes([(i * 7 + j) % 251 for j in range(251)]) * (size // 251) + bytes(size % 251)


def blocks(ids: range | list[int], size: int) -> bytes:
    return b"".join(block(i, size) for i in ids)


def open_store(
    tmp_path: Path, num_slots: int = 8, block_bytes: int = 4096, **kw: object
) -> NvmeStore:
    slot = -(-block_bytes // ALIGN_BYTES) * ALIGN_BYTES
    store = NvmeStore.open(
        NvmeConfig(tmp_path, capacity_bytes=num_slots * slot, block_bytes=block_bytes, **kw)  # type: ignore[arg-type]
    )
    assert store is not None
    return store


def read(store: NvmeStore, hashes: list[bytes]) -> tuple[int, bytes]:
    out = bytearray(len(hashes) * store.block_bytes)
    n = store.read_into(hashes, out)
    return n, bytes(out[: n * store.block_bytes])


@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("block_bytes", [4096, 5000])
def test_round_trip_in_canonical_slots(
    tmp_path: Path, direct: bool | None, block_bytes: int
) -> None:
    store = open_store(tmp_path, num_slots=8, block_bytes=block_bytes, direct=direct)
    assert store.slot_bytes == (4096 if block_bytes == 4096 else 8192)
    assert os.path.getsize(tmp_path / STORE_FILENAME) == 8 * store.slot_bytes
    assert store.put(DIGEST_A, [h(0), h(1), h(2)], blocks(range(3), block_bytes)) == 3
    assert read(store, [h(0), h(1), h(2), h(3)]) == (3, blocks(range(3), block_bytes))
    assert store.leading([h(0), h(1), h(9)]) == 2
    # Slot i of the file holds block i, padded to the slot: the layout is the file's, not a log.
    raw = (tmp_path / STORE_FILENAME).read_bytes()
    assert raw[store.slot_bytes : store.slot_bytes + block_bytes] == block(1, block_bytes)
    # Already held blocks are not written again.
    assert store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), block_bytes)) == 0
    assert store.stats.num_blocks_written == 3


def test_direct_io_is_used_where_the_filesystem_allows_it(tmp_path: Path) -> None:
    store = open_store(tmp_path, direct=None)
    # ext4 and xfs (the test machine, an NVMe PV) take O_DIRECT; tmpfs refuses it.
    fs_takes_direct = _fs_takes_direct(tmp_path)
    assert store.direct is fs_takes_direct
    buffered = open_store(tmp_path / ".." / tmp_path.name, direct=False)
    assert buffered.direct is False


def _fs_takes_direct(path: Path) -> bool:
    probe = path / "probe"
    probe.write_bytes(b"")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    try:
        buf = aligned_buffer(ALIGN_BYTES)
        os.pwritev(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def test_zero_copy_reads_into_an_aligned_buffer(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=8, block_bytes=8192)
    store.put(DIGEST_A, [h(i) for i in range(4)], blocks(range(4), 8192))
    out = aligned_buffer(4 * 8192)
    assert store.read_into([h(i) for i in range(4)], out) == 4
    assert bytes(out) == blocks(range(4), 8192)


@pytest.mark.parametrize("direct", [None, False])
def test_zero_copy_writes_from_an_aligned_buffer(tmp_path: Path, direct: bool | None) -> None:
    store = open_store(tmp_path, num_slots=8, block_bytes=8192, direct=direct)
    data = aligned_buffer(3 * 8192)
    data.write(blocks(range(3), 8192))
    # From the caller's memory straight to the file (an offset slice stays page-aligned).
    assert store.put(DIGEST_A, [h(i) for i in range(2)], memoryview(data)[8192:]) == 2
    assert read(store, [h(0), h(1)]) == (2, blocks(range(1, 3), 8192))
    assert (tmp_path / STORE_FILENAME).read_bytes()[: 2 * 8192] == blocks(range(1, 3), 8192)


def test_the_ring_overwrites_the_oldest_run_and_wraps_runs_whole(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=5)
    assert store.put(DIGEST_A, [h(0), h(1), h(2)], blocks(range(3), 4096)) == 3  # slots 0-2
    assert store.put(DIGEST_A, [h(3), h(4)], blocks(range(3, 5), 4096)) == 2  # slots 3-4
    # Three more blocks do not fit after slot 4: the run wraps to slot 0 and evicts 0, 1, 2.
    assert store.put(DIGEST_A, [h(5), h(6), h(7)], blocks(range(5, 8), 4096)) == 3
    assert [store.leading([h(i)]) for i in range(8)] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert store.stats.num_evictions == 3
    assert read(store, [h(5), h(6), h(7)]) == (3, blocks(range(5, 8), 4096))
    # The next run lands in slots 3-4 (after the head), evicting blocks 3 and 4.
    assert store.put(DIGEST_A, [h(8)], block(8, 4096)) == 1
    assert [store.leading([h(i)]) for i in (3, 4, 8)] == [0, 1, 1]
    assert len(store) == 5


def test_a_run_longer_than_the_store_keeps_its_head(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=3)
    assert store.put(DIGEST_A, [h(i) for i in range(5)], blocks(range(5), 4096)) == 5
    # Written in ring-sized pieces: the last piece wins the slots; nothing wrong is served.
    held = [i for i in range(5) if store.leading([h(i)])]
    for i in held:
        assert read(store, [h(i)]) == (1, block(i, 4096))
    assert len(store) == 3


def test_a_corrupt_block_is_dropped_and_only_the_verified_prefix_served(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=8)
    store.put(DIGEST_A, [h(i) for i in range(4)], blocks(range(4), 4096))
    with open(tmp_path / STORE_FILENAME, "r+b") as f:  # a flipped byte in block 2
        f.seek(2 * 4096 + 100)
        byte = f.read(1)
        f.seek(2 * 4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert read(store, [h(i) for i in range(4)]) == (2, blocks(range(2), 4096))
    assert store.stats.num_corrupt == 1
    assert store.leading([h(0), h(1), h(2), h(3)]) == 2  # forgotten: the next read recomputes
    assert read(store, [h(2), h(3)]) == (0, b"")


def test_a_truncated_file_reads_nothing(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=8)
    store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), 4096))
    os.truncate(tmp_path / STORE_FILENAME, 4096)  # someone else shrank it: a short read
    # One preadv covers the run: a short read fails it whole.
    assert read(store, [h(0), h(1)]) == (0, b"")
    assert store.stats.num_read_errors == 1
    assert store.leading([h(0), h(1)]) == 0


def test_io_errors_on_write_and_read_degrade_to_recompute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real disk cannot be made to fail on demand here: these two faults are injected.
    store = open_store(tmp_path, num_slots=8)
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def full_disk(fd: int, bufs: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full_disk)
    assert store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), 4096)) == 0
    assert store.stats.num_write_errors == 1 and len(store) == 0
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    assert store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), 4096)) == 2

    def eio(fd: int, bufs: object, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)
    assert read(store, [h(0), h(1)]) == (0, b"")
    assert store.stats.num_read_errors == 1
    monkeypatch.setattr(os, "preadv", real_preadv)
    assert read(store, [h(0), h(1)]) == (0, b"")  # the failed blocks were forgotten


def test_a_missing_directory_or_a_disk_too_small_leaves_t3_off(tmp_path: Path) -> None:
    assert NvmeStore.open(NvmeConfig(tmp_path / "gone", 1 << 20, 4096)) is None
    # A real "disk too small": the file size limit of a child process (preallocation fails).
    code = (
        "import resource, sys; from pathlib import Path;"
        "from kvfleet_runtime.nvme import NvmeStore, NvmeConfig, STORE_FILENAME;"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({1 << 20}, {1 << 20}));"
        f"s = NvmeStore.open(NvmeConfig(Path({str(tmp_path)!r}), {64 << 20}, 4096));"
        f"print(s is None, (Path({str(tmp_path)!r}) / STORE_FILENAME).exists())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["True", "False"]
    assert "cannot preallocate 67108864 bytes" in out.stderr
    assert resource.getrlimit(resource.RLIMIT_FSIZE)  # this process is untouched


def test_a_disk_full_mid_write_is_a_failed_write(tmp_path: Path) -> None:
    # Preallocation reserves the blocks, so a real ENOSPC at write time needs the file to be
    # sparse again: punch the preallocation and cap the file size (EFBIG, a real kernel error).
    code = (
        "import os, resource, signal; from pathlib import Path;"
        "from kvfleet_runtime.nvme import NvmeStore, NvmeConfig;"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
        f"s = NvmeStore.open(NvmeConfig(Path({str(tmp_path)!r}), {8 * 4096}, 4096, direct=False));"
        "os.ftruncate(s._fd, 4096);"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096));"
        "print(s.put('d', [b'a' * 16, b'b' * 16], bytes(8192)), s.stats.num_write_errors, len(s))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["0", "1", "0"]


def test_invalidate_forgets_one_weights_version(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=8)
    store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), 4096))
    store.put(DIGEST_B, [h(2)], block(2, 4096))
    assert store.invalidate(DIGEST_A) == 2
    assert [store.leading([h(i)]) for i in range(3)] == [0, 0, 1]
    assert len(store) == 1 and store.stats.num_invalidated == 2
    assert read(store, [h(0)]) == (0, b"")
    assert read(store, [h(2)]) == (1, block(2, 4096))  # the other version is untouched
    # Their slots are free: the ring's next writes take them without evicting anything.
    store.put(DIGEST_A, [h(3), h(4), h(5), h(6), h(7)], blocks(range(3, 8), 4096))
    assert store.stats.num_evictions == 0 and len(store) == 6


def test_a_write_queued_before_an_invalidate_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=8)
    queued_at = store.epoch(DIGEST_A)  # what the tier records when it queues a write
    store.invalidate(DIGEST_A)
    assert store.put(DIGEST_A, [h(0)], block(0, 4096), epoch=queued_at) == 0
    assert len(store) == 0 and store.stats.num_stale_writes == 1
    # A write decided after the invalidation, or of another version, is stored.
    assert store.put(DIGEST_A, [h(1)], block(1, 4096), epoch=store.epoch(DIGEST_A)) == 1
    assert store.put(DIGEST_B, [h(2)], block(2, 4096), epoch=queued_at) == 1


def test_a_write_in_flight_during_an_invalidate_is_not_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path, num_slots=8)
    real_pwritev = os.pwritev

    def invalidated_meanwhile(fd: int, bufs: list[memoryview], offset: int) -> int:
        done = real_pwritev(fd, bufs, offset)
        # The write reached the file; the operator withdraws the version before it is indexed.
        t = threading.Thread(target=store.invalidate, args=(DIGEST_A,))
        t.start()
        t.join()
        return done

    monkeypatch.setattr(os, "pwritev", invalidated_meanwhile)
    assert store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), 4096)) == 0
    assert len(store) == 0 and store.stats.num_stale_writes == 2
    assert read(store, [h(0)]) == (0, b"")


def test_a_read_in_flight_during_an_invalidate_returns_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path, num_slots=8)
    store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), 4096))
    real_preadv = os.preadv

    def invalidated_meanwhile(fd: int, bufs: list[memoryview], offset: int) -> int:
        got = real_preadv(fd, bufs, offset)
        t = threading.Thread(target=store.invalidate, args=(DIGEST_A,))
        t.start()
        t.join()
        return got

    monkeypatch.setattr(os, "preadv", invalidated_meanwhile)
    assert read(store, [h(0), h(1)]) == (0, b"")
    assert store.stats.num_raced == 2


def test_an_old_file_is_never_trusted(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=4)
    store.put(DIGEST_A, [h(0)], block(0, 4096))
    store.close()
    again = open_store(tmp_path, num_slots=4)
    assert len(again) == 0
    assert (tmp_path / STORE_FILENAME).read_bytes()[:4096] != block(0, 4096)
    assert read(store, [h(0)]) == (0, b"")  # a closed store reads nothing


def test_a_read_racing_a_write_into_its_slots_discards_what_it_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(tmp_path, num_slots=2)
    store.put(DIGEST_A, [h(0), h(1)], blocks(range(2), 4096))
    real_preadv = os.preadv
    wrote = threading.Event()

    def slow_read(fd: int, bufs: list[memoryview], offset: int) -> int:
        got = real_preadv(fd, bufs, offset)
        # While this read is "in flight", a writer takes both slots.
        t = threading.Thread(
            target=store.put, args=(DIGEST_A, [h(2), h(3)], blocks(range(2, 4), 4096))
        )
        t.start()
        t.join()
        wrote.set()
        return got

    monkeypatch.setattr(os, "preadv", slow_read)
    assert read(store, [h(0), h(1)]) == (0, b"")
    assert wrote.is_set() and store.stats.num_raced == 2
    monkeypatch.setattr(os, "preadv", real_preadv)
    assert read(store, [h(2), h(3)]) == (2, blocks(range(2, 4), 4096))


def test_buffered_mode_syncs_after_the_configured_bytes(tmp_path: Path) -> None:
    store = open_store(tmp_path, num_slots=8, direct=False, fsync_every_bytes=3 * 4096)
    for i in range(6):
        store.put(DIGEST_A, [h(i)], block(i, 4096))
    assert store.stats.num_fsyncs == 2


def test_bad_input_is_a_value_error_naming_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_bytes must be > 0, got 0"):
        NvmeConfig(tmp_path, 1 << 20, 0)
    with pytest.raises(ValueError, match="at least one 4096-byte slot, got 100"):
        NvmeConfig(tmp_path, 100, 4096)
    store = open_store(tmp_path)
    with pytest.raises(ValueError, match="data must be 2 x 4096 bytes, got 4096"):
        store.put(DIGEST_A, [h(0), h(1)], block(0, 4096))


def test_bandwidth_is_recorded_per_concurrency_level() -> None:
    rec = BandwidthRecorder()
    rec.record(1, 2_000_000_000, 1.0)  # 2 GB/s
    rec.record(4, 1_000_000_000, 1.0)  # 1 GB/s per read, 4 at once
    rec.record(4, 3_000_000_000, 1.0)
    assert rec.per_read_gb_s(1) == 2.0
    assert rec.aggregate_gb_s(4) == 8.0
    assert rec.counts[4] == [0, 0, 1, 0, 1, 0, 0, 0, 0, 0]
    assert [concurrency_bucket(n) for n in (1, 2, 3, 5, 9, 100)] == [1, 2, 4, 8, 16, 32]
