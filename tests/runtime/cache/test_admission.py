"""Count-min sketch with aging, the bounded priority store queue, inferred placement, thrash."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvfleet_runtime.cache import CacheTuning
from kvfleet_runtime.cache._admission import Placement, ThrashDetector, place
from kvfleet_runtime.cache._manager import CacheManager, StoreOutcome, StorePlan
from kvfleet_runtime.cache._sketch import CountMinSketch
from kvfleet_runtime.cache._store_queue import StoreQueue

from .conftest import make_key


def test_sketch_counts_saturate_and_age() -> None:
    sketch = CountMinSketch(width=64, depth=4, sample_size=1000)
    h = bytes(range(16))
    assert sketch.estimate(h) == 0
    assert [sketch.increment(h) for _ in range(3)] == [1, 2, 3]
    for _ in range(300):
        sketch.increment(h)
    assert sketch.estimate(h) == 255  # saturates at a byte
    sketch.age()
    assert sketch.estimate(h) == 127 and sketch.num_resets == 1


def test_sketch_batch_and_single_paths_agree() -> None:
    sketch = CountMinSketch(width=1024, depth=4)
    hashes = [bytes([i]) * 16 for i in range(40)]
    assert sketch.increment_many(hashes) == [1] * 40
    sketch.increment_many(hashes[:10])
    assert sketch.estimate_many(hashes) == [sketch.estimate(h) for h in hashes]
    assert sketch.estimate_many(hashes)[:12] == [2] * 10 + [1] * 2


@pytest.mark.parametrize("width", [1, 4, 1024])
def test_sketch_short_chain_path_gives_the_batch_path_counters(
    width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chains of up to 8 blocks count in pure Python; where two ids of a chain share a counter
    (every one does at width 1) the batch rule applies, so both paths agree exactly."""
    import random

    from kvfleet_runtime.cache import _sketch

    rng = random.Random(7)
    chains = [[rng.randbytes(16) for _ in range(rng.randint(1, 8))] for _ in range(300)]
    chains += [[chains[0][0]] * 3]  # one id twice in a chain: always a shared counter
    scalar = CountMinSketch(width=width, depth=4, sample_size=500)
    got = [scalar.increment_many(c) for c in chains]
    monkeypatch.setattr(_sketch, "_SCALAR_MAX_HASHES", 0)
    batch = CountMinSketch(width=width, depth=4, sample_size=500)
    assert got == [batch.increment_many(c) for c in chains]
    assert bytes(scalar._counters) == bytes(batch._counters) and scalar.num_resets > 0
    assert scalar.num_resets == batch.num_resets


def test_sketch_ages_itself_after_sample_size_increments() -> None:
    sketch = CountMinSketch(width=64, depth=2, sample_size=8)
    h = bytes(16)
    for _ in range(7):
        sketch.increment(h)
    assert sketch.estimate(h) == 7
    sketch.increment(h)  # the 8th increment triggers the halving
    assert sketch.estimate(h) == 4 and sketch.num_resets == 1


@pytest.mark.parametrize(("width", "depth"), [(0, 4), (100, 4), (64, 0), (64, 5)])
def test_sketch_rejects_bad_shapes(width: int, depth: int) -> None:
    with pytest.raises(ValueError, match=str(width if width in (0, 100) else depth)):
        CountMinSketch(width=width, depth=depth)


def test_queue_drops_the_least_valuable_entry_not_the_newest() -> None:
    q: StoreQueue[str] = StoreQueue(3)
    assert q.push(10, "a") is None
    assert q.push(50, "b") is None
    assert q.push(30, "c") is None
    assert q.push(40, "d") == "a"  # full: the lowest priority goes, the newcomer stays
    assert q.push(5, "e") == "e"  # a newcomer worth less than everything pending is refused
    assert q.push(30, "f") == "c"  # ties: the older of equal value goes
    assert q.priorities() == [30, 40, 50]
    assert [q.pop(), q.pop(), q.pop(), q.pop()] == ["b", "d", "f", None]


def test_queue_pops_the_oldest_among_equal_priorities() -> None:
    q: StoreQueue[str] = StoreQueue(4)
    for name in "xyz":
        q.push(7, name)
    assert [q.pop(), q.pop(), q.pop()] == ["x", "y", "z"]


def test_queue_is_safe_under_concurrent_push_and_pop() -> None:
    q: StoreQueue[int] = StoreQueue(16)
    popped: list[int] = []
    dropped: list[int] = []

    def producer(base: int) -> None:
        for i in range(500):
            d = q.push(i % 37, base + i)
            if d is not None:
                dropped.append(d)

    def consumer() -> None:
        for _ in range(2000):
            item = q.pop()
            if item is not None:
                popped.append(item)

    threads = [threading.Thread(target=producer, args=(b,)) for b in (0, 10_000)]
    threads.append(threading.Thread(target=consumer))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while (item := q.pop()) is not None:
        popped.append(item)
    assert sorted(popped + dropped) == sorted([*range(500), *range(10_000, 10_500)])


@pytest.mark.parametrize(
    ("sightings", "prefix_bytes", "thrashing", "expected"),
    [
        (1, 10, False, Placement.NOT_STORED),  # one-shot so far
        (2, 10, False, Placement.REUSED),
        (3, 10, False, Placement.PINNED),  # hot and small
        (3, 10**9, False, Placement.REUSED),  # hot but large
        (2, 10, True, Placement.NOT_STORED),  # thrashing: stricter admission
        (3, 10, True, Placement.PINNED),
    ],
)
def test_placement_is_inferred_from_reuse(
    sightings: int, prefix_bytes: int, thrashing: bool, expected: Placement
) -> None:
    got = place(
        sightings,
        prefix_bytes,
        admit_min_sightings=2,
        hot_min_sightings=3,
        pin_max_bytes=1000,
        thrashing=thrashing,
    )
    assert got is expected


def test_thrash_detector_needs_sustained_pressure_and_has_hysteresis() -> None:
    d = ThrashDetector(ratio=0.9, window_s=10.0, sustain_s=30.0, min_blocks=10)
    t = 0.0
    for _ in range(3):  # three windows where almost every offered block is evicted
        d.record(t, offered=100, dropped=95)
        t += 10.0
    d.record(t)
    assert d.thrashing and d.num_episodes == 1
    d.record(t, offered=100, dropped=80)  # below 0.9 but above 0.45: stays engaged
    t += 10.0
    d.record(t)
    assert d.thrashing
    d.record(t, offered=100, dropped=10)
    d.record(t + 10.0)
    assert not d.thrashing


def test_thrash_detector_ignores_short_bursts() -> None:
    d = ThrashDetector(ratio=0.9, window_s=10.0, sustain_s=30.0, min_blocks=10)
    d.record(0.0, offered=100, dropped=100)
    d.record(10.0, offered=100, dropped=0)
    d.record(20.0, offered=100, dropped=100)
    d.record(30.0)
    assert not d.thrashing


@pytest.mark.parametrize(
    "label",
    [
        lambda i: i.to_bytes(16, "little"),  # sequential ids: 96 zero bits
        lambda i: i.to_bytes(16, "big"),
        lambda i: (i << 100).to_bytes(16, "little"),  # only the top bits vary
    ],
)
def test_sketch_counts_structured_ids_exactly(label: Callable[[int], bytes]) -> None:
    # Row indices must mix the whole id: slicing it gave every sequential id the same counter in
    # three rows, and the batch update then lost increments on that shared counter.
    sketch = CountMinSketch(width=1 << 12, depth=4)
    ids = [label(i) for i in range(200)]
    for n in range(1, 8):  # like requests: a reused head, then a one-shot tail
        sketch.increment_many([*ids[: 200 // n], label(1000 + n)])
    expected = [sum(1 for n in range(1, 8) if i < 200 // n) for i in range(200)]
    assert sketch.estimate_many(ids) == expected
    assert [sketch.estimate(x) for x in ids] == expected


def test_one_store_writes_at_most_its_share_of_the_cache_and_the_prefix_grows() -> None:
    # 8 blocks, a store may write a quarter of them (2) or the free room, whichever is more,
    # under a ranking that counts reuse (the cap protects counted prefixes).
    config = CacheTuning(
        num_t0_blocks=8,
        store_max_fraction=0.25,
        store_min_blocks=1,
        admit_min_sightings=2,
        eviction_rankings=(3,),
    )
    manager = CacheManager(config, bytes_per_block=1, clock=lambda: 0.0)
    assert manager._store_max_blocks == 2
    key = make_key()
    other = [bytes([i]) * 16 for i in range(100, 106)]
    manager.plan_store(key, other)
    plan = manager.plan_store(key, other)
    assert isinstance(plan, StorePlan) and len(plan.hashes) == 6  # 8 free: the whole chain
    manager.finish_commit(manager.commit(plan))
    chain = [bytes([i]) * 16 for i in range(1, 6)]
    assert manager.plan_store(key, chain) is StoreOutcome.REFUSED  # first sighting
    matched = []
    for _ in range(3):
        plan = manager.plan_store(key, chain)
        assert isinstance(plan, StorePlan)
        manager.finish_commit(manager.commit(plan))
        path = manager.lookup(key, chain, 16 * len(chain))
        matched.append((plan.start_block, len(plan.hashes), len(path)))
        manager.release(path)
    # Each sighting extends the cached prefix by at most 2 blocks, from what is resident; the
    # other chain gives up its deepest blocks, one leaf at a time (6 -> 3 resident).
    assert matched == [(0, 2, 2), (2, 4, 4), (4, 5, 5)]
    assert manager.plan_store(key, chain) is StoreOutcome.RESIDENT
    assert len(manager._index.match(other)) == 3
    assert manager.stats().totals.num_admissions_refused == 6 + 5  # first sightings only


def test_under_plain_recency_a_store_is_not_cut_by_the_cap() -> None:
    # The same cache as above, ranked by recency (vLLM's order): a prompt that does not fit the
    # free room is stored whole, evicting the least recent blocks, as vLLM would.
    config = CacheTuning(
        num_t0_blocks=8, store_max_fraction=0.25, store_min_blocks=1, eviction_rankings=(1,)
    )
    manager = CacheManager(config, bytes_per_block=1, clock=lambda: 0.0)
    key = make_key()
    other = [bytes([i]) * 16 for i in range(100, 106)]
    manager.finish_commit(manager.commit(_plan(manager.plan_store(key, other))))
    chain = [bytes([i]) * 16 for i in range(1, 6)]
    plan = _plan(manager.plan_store(key, chain))
    assert (plan.start_block, len(plan.hashes)) == (0, 5)  # 2 free, cap 2: stored whole anyway
    manager.finish_commit(manager.commit(plan))
    assert len(manager._index.match(chain)) == 5 and len(manager._index.match(other)) == 3
    manager._index.check_invariants()


def _plan(plan: StorePlan | StoreOutcome) -> StorePlan:
    assert isinstance(plan, StorePlan), plan
    return plan


def test_store_cap_floor_keeps_small_caches_storing_whole_prompts() -> None:
    def cap(t0: int, t1: int = 0) -> int:
        config = CacheTuning(num_t0_blocks=t0, num_t1_blocks=t1)
        return CacheManager(config, bytes_per_block=1, clock=lambda: 0.0)._store_max_blocks

    assert cap(512, 2048) == 1024  # the floor (the server's default pools)
    assert cap(13_321) == 1332  # 10% of a 1% cache of the Mooncake trace
    assert cap(1000, 39_000) == 4000  # T1 counts
    with pytest.raises(ValueError, match="store_max_fraction"):
        CacheTuning(num_t0_blocks=8, store_max_fraction=0.0)
    with pytest.raises(ValueError, match="store_max_fraction"):
        CacheTuning(num_t0_blocks=8, store_max_fraction=1.5)
    with pytest.raises(ValueError, match="store_min_blocks"):
        CacheTuning(num_t0_blocks=8, store_min_blocks=0)
