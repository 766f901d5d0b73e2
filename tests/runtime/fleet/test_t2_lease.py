"""T2 over NIXL, the pure parts: the lease table (expiry, release, budget, tenants) and the
descriptor pairing (every byte of every block lands where it belongs, stretches merged)."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from kvfleet_runtime.fleet.t2_lease import LeaseTable, PoolGeometry, pair_descriptors
from tests.support import FakeClock


class Pins:
    def __init__(self) -> None:
        self.unpinned: list[str] = []

    def unpin(self, name: str) -> object:
        return lambda: self.unpinned.append(name)


def table(clock: FakeClock, max_blocks: int = 10) -> LeaseTable:
    ids = (f"lease-{i}" for i in itertools.count())
    return LeaseTable(ttl_s=2.0, max_blocks=max_blocks, clock=clock, new_id=lambda: next(ids))


def test_release_of_a_live_lease_vouches_and_unpins_once() -> None:
    clock, pins = FakeClock(), Pins()
    leases = table(clock)
    lease = leases.grant("a", 3, pins.unpin("run"))  # type: ignore[arg-type]
    assert lease is not None and leases.num_leased_blocks == 3
    clock.advance(1.9)
    assert leases.release(lease.lease_id, "a") is lease
    assert pins.unpinned == ["run"]
    assert leases.release(lease.lease_id, "a") is None  # once
    assert pins.unpinned == ["run"] and len(leases) == 0


def test_an_expired_lease_unpins_and_no_longer_vouches() -> None:
    clock, pins = FakeClock(), Pins()
    leases = table(clock)
    lease = leases.grant("a", 3, pins.unpin("run"))  # type: ignore[arg-type]
    assert lease is not None
    clock.advance(1.0)
    assert leases.expire() == 0 and pins.unpinned == []  # pinned until its expiry
    clock.advance(1.0)
    assert leases.expire() == 1 and pins.unpinned == ["run"]
    assert leases.release(lease.lease_id, "a") is None
    assert leases.num_expired == 1 and pins.unpinned == ["run"]


def test_a_release_expires_first() -> None:
    clock, pins = FakeClock(), Pins()
    leases = table(clock)
    lease = leases.grant("a", 1, pins.unpin("run"))  # type: ignore[arg-type]
    assert lease is not None
    clock.advance(2.5)  # no timer ran: the release itself finds it expired
    assert leases.release(lease.lease_id, "a") is None
    assert pins.unpinned == ["run"]


def test_another_tenant_cannot_end_a_lease() -> None:
    clock, pins = FakeClock(), Pins()
    leases = table(clock)
    lease = leases.grant("a", 2, pins.unpin("run"))  # type: ignore[arg-type]
    assert lease is not None
    assert leases.release(lease.lease_id, "b") is None
    assert pins.unpinned == [] and leases.num_leased_blocks == 2
    assert leases.release(lease.lease_id, "a") is lease


def test_the_budget_bounds_pinned_blocks() -> None:
    clock, pins = FakeClock(), Pins()
    leases = table(clock, max_blocks=5)
    first = leases.grant("a", 4, pins.unpin("first"))  # type: ignore[arg-type]
    assert first is not None
    assert leases.grant("b", 2, pins.unpin("refused")) is None  # type: ignore[arg-type]
    assert pins.unpinned == ["refused"]  # a refused grant pins nothing
    clock.advance(2.0)  # the first expires: room again
    assert leases.grant("b", 2, pins.unpin("second")) is not None  # type: ignore[arg-type]
    assert pins.unpinned == ["refused", "first"]
    leases.release_all()
    assert pins.unpinned == ["refused", "first", "second"] and len(leases) == 0


LAYERS, PIECE = 3, 24  # a layer of a block: 24 bytes


def pool(num_blocks: int, seed: int) -> tuple[np.ndarray, PoolGeometry]:
    """K|V `[2, layers, blocks, PIECE]` bytes, and its geometry."""
    data = np.random.default_rng(seed).integers(0, 256, (2, LAYERS, num_blocks, PIECE),
                                                dtype=np.uint8)
    base = data.ctypes.data
    return data, PoolGeometry(base, base + data[1].ctypes.data - data[0].ctypes.data,
                              num_blocks * PIECE, PIECE, PIECE, LAYERS, num_blocks)


def transfer(descriptors: list) -> int:
    """What NIXL does with the lists: copy every remote stretch onto its local pair."""
    count = 0
    for d in descriptors:
        assert d.local.shape == d.remote.shape and (d.local[:, 1] == d.remote[:, 1]).all()
        for (dst, n, _), (src, _, _) in zip(d.local, d.remote, strict=True):
            ctypes.memmove(int(dst), int(src), int(n))
        count += len(d.local)
    return count


def test_every_block_lands_in_its_slot_and_stretches_merge() -> None:
    (t0, g0), (t1, g1) = pool(8, 1), pool(6, 2)  # a server's T0 and T1
    dst, gd = pool(10, 3)
    remote_slots = [(0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (0, 7)]
    local_slots = [(0, 5), (0, 6), (0, 7), (0, 8), (0, 0), (0, 1)]
    descriptors = pair_descriptors([gd], local_slots, [g0, g1], remote_slots)
    rows = transfer(descriptors)
    # runs: T0 2-4 -> 5-7 (merged), T1 0 -> 8, T1 1 -> 0 (not adjacent locally), T0 7 -> 1
    assert rows == 2 * LAYERS * 4
    pools = [t0, t1]
    for (_, ls), (rp, rs) in zip(local_slots, remote_slots, strict=True):
        assert np.array_equal(dst[:, :, ls], pools[rp][:, :, rs])
    assert sum(d.num_bytes for d in descriptors) == len(local_slots) * 2 * LAYERS * PIECE


def test_memory_types_are_never_mixed_in_one_list() -> None:
    (_, g0), (_, g1) = pool(4, 1), pool(4, 2)
    gpu = PoolGeometry(g0.k_addr, g0.v_addr, g0.layer_stride, g0.block_stride, PIECE, LAYERS, 4,
                       mem="VRAM")
    _, gd = pool(4, 3)
    descriptors = pair_descriptors([gd], [(0, 0), (0, 1)], [gpu, g1], [(0, 0), (1, 1)])
    assert sorted((d.local_mem, d.remote_mem) for d in descriptors) == [("DRAM", "DRAM"),
                                                                         ("DRAM", "VRAM")]


@pytest.mark.parametrize("bad", [
    dict(local_slots=[(0, 0)], remote_slots=[(0, 0), (0, 1)]),
    dict(local_slots=[(0, 9)], remote_slots=[(0, 0)]),
    dict(local_slots=[(1, 0)], remote_slots=[(0, 0)]),
])
def test_slots_outside_the_pools_or_unequal_runs_are_refused(bad: dict) -> None:
    _, g = pool(4, 1)
    with pytest.raises(ValueError):
        pair_descriptors([g], bad["local_slots"], [g], bad["remote_slots"])


def test_blocks_of_another_size_are_refused() -> None:
    _, g = pool(4, 1)
    other = PoolGeometry(g.k_addr, g.v_addr, g.layer_stride, PIECE * 2, PIECE * 2, LAYERS, 2)
    with pytest.raises(ValueError):
        pair_descriptors([g], [(0, 0)], [other], [(0, 0)])


def test_geometry_round_trips_and_refuses_garbage() -> None:
    _, g = pool(4, 1)
    assert PoolGeometry.from_json(g.to_json()) == g
    for bad in [None, {}, {**g.to_json(), "k": -1}, {**g.to_json(), "mem": "DISK"},
                {**g.to_json(), "piece_bytes": 0}, {**g.to_json(), "layers": "3"}]:
        with pytest.raises(ValueError):
            PoolGeometry.from_json(bad)
