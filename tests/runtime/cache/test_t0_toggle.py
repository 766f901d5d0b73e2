"""T0 off, live, on a real PrefixCache bound to an engine-style block pool (exact block ids): the
cached T0 blocks leave T0 at once (demoted to T1 by copy when T1 takes them, else unreachable and
freed), stores stop being indexed in place and are copied to T1 instead, lookups never hit T0, a
sequence holding T0 blocks keeps reading them and gives them back at its end; T0 on again indexes
stores in place again."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_runtime.cache import BLOCK_SIZE, BlockEvent, Hit, Miss, StoreOutcome, Tier
from tests.runtime.cache.conftest import FakeClock, make_key
from tests.runtime.cache.test_t0_pool import (
    _expected,
    bound,
    compute,
    pool,
    prompt,
    run_sequence,
    start_checked,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def used(cache: object) -> tuple[int, int]:
    t0, t1 = cache.stats().tiers  # type: ignore[attr-defined]
    return int(t0.num_blocks_used), int(t1.num_blocks_used)


def test_t0_off_demotes_cached_blocks_to_t1_and_stores_go_to_t1_by_copy(
    clock: FakeClock,
) -> None:
    kv = pool(11)
    cache = bound(kv, clock, t1=8)
    a, b = prompt(3, 1), prompt(2, 2)
    assert run_sequence(cache, kv, a, 1) == [0, 1, 2]
    assert run_sequence(cache, kv, b, 2) == [3, 4]
    reference = cache.read_blocks(cache.block_hashes(make_key(), a))
    assert reference is not None
    assert used(cache) == (5, 0) and cache.t0_enabled
    events: list[BlockEvent] = []
    cache.add_listener(events.append)

    assert cache.set_t0_enabled(False) == (5, 0)  # 5 demoted, none lost
    assert not cache.t0_enabled
    assert used(cache) == (0, 5)
    assert (kv.refs.num_free, kv.num_cached_blocks) == (11, 0)  # the whole pool is the engine's
    assert events == []  # demoted blocks stay on this host: nothing to withdraw
    assert cache.stats().tiers[0].num_demotions == 5

    hit = cache.lookup(make_key(), [*a, 9])
    assert isinstance(hit, Hit) and hit.tier is Tier.T1 and hit.matched_tokens == 48
    assert cache._share_prefix(hit, kv, 3) == []  # nothing of T0 to share
    table = kv.take(4)
    assert table == [0, 1, 2, 3]
    cache._copy_into(hit, kv, table, 0, 3)
    got = cache.read_blocks(cache.block_hashes(make_key(), a))
    assert got is not None and torch.equal(got[0], reference[0])
    assert torch.equal(got[1], reference[1])
    for i, block in enumerate(table[:3]):  # the copy is the demoted data, exactly
        assert torch.equal(kv.k[:, block], reference[0][:, :, i * 16 : (i + 1) * 16])
    assert used(cache) == (0, 5)  # not promoted back into T0 while it is off
    kv.give_back(table)
    cache.release(hit)

    c = prompt(2, 3)
    table = kv.take(2)
    assert table is not None
    compute(kv, table, 3)
    assert cache._store_blocks(make_key(), c, kv, table) is StoreOutcome.QUEUED  # a copy
    assert kv.refs.ref_count(table[0]) == 2  # the pending copy holds the blocks
    kv.give_back(table)
    assert cache.drain_store_queue() == 2
    assert used(cache) == (0, 7)
    assert (kv.refs.num_free, kv.num_cached_blocks) == (11, 0)
    cache._manager._index.check_invariants()

    assert cache.set_t0_enabled(True) == (0, 0)
    d = prompt(2, 4)
    assert run_sequence(cache, kv, d, 4) == [0, 1]  # indexed in place again
    assert used(cache) == (2, 7)
    again = cache.lookup(make_key(), [*d, 9])
    assert isinstance(again, Hit) and again.tier is Tier.T0
    cache.release(again)
    cache._manager._index.check_invariants()


def test_t0_off_without_t1_frees_every_cached_block_and_stores_nothing(
    clock: FakeClock,
) -> None:
    kv = pool(11)
    cache = bound(kv, clock)
    a, b = prompt(3, 1), prompt(2, 2)
    run_sequence(cache, kv, a, 1)
    run_sequence(cache, kv, b, 2)
    removed: list[int] = []
    cache.add_listener(lambda e: removed.append(len(e.block_hashes)) if e.kind == "removed"
                       else None)
    assert cache.set_t0_enabled(False) == (0, 5)
    assert removed == [5]  # withdrawn from the hint index (one event per key)
    assert used(cache) == (0, 0)
    assert (kv.refs.num_free, kv.num_cached_blocks) == (11, 0)
    assert isinstance(cache.lookup(make_key(), [*a, 9]), Miss)
    table = kv.take(3)
    assert table is not None
    compute(kv, table, 1)
    assert cache._store_blocks(make_key(), a, kv, table) is StoreOutcome.QUEUED
    kv.give_back(table)
    assert cache.drain_store_queue() == 0  # no tier takes it
    assert (kv.refs.num_free, kv.num_cached_blocks) == (11, 0)  # and the hold was given back
    assert isinstance(cache.lookup(make_key(), [*a, 9]), Miss)
    cache._manager._index.check_invariants()


def test_an_in_flight_sequence_keeps_its_t0_blocks_and_gives_them_back_at_its_end(
    clock: FakeClock,
) -> None:
    kv = pool(11)
    cache = bound(kv, clock)
    a = prompt(3, 1)
    run_sequence(cache, kv, a, 1)
    snapshot = kv.k[:, [0, 1, 2]].clone()
    hit = cache.lookup(make_key(), [*a, 9])
    assert isinstance(hit, Hit)
    shared = cache._share_prefix(hit, kv, 3)
    assert shared == [0, 1, 2]
    fresh = kv.take(1)
    assert fresh == [3]

    assert cache.set_t0_enabled(False) == (0, 3)
    assert isinstance(cache.lookup(make_key(), [*a, 9]), Miss)  # unreachable at once
    assert used(cache) == (3, 0)  # still held (the hit's refs) until the sequence ends
    assert kv.refs.num_free == 7
    other = kv.take(7)  # new work gets the rest, never the blocks the sequence reads
    assert other is not None and not set(other) & {0, 1, 2, 3}
    assert torch.equal(kv.k[:, shared], snapshot)
    kv.give_back(other)
    cache._manager._index.check_invariants(held=hit._path)

    kv.give_back(shared + fresh)  # the sequence ends
    cache.release(hit)
    assert used(cache) == (0, 0)
    assert (kv.refs.num_free, kv.num_cached_blocks) == (11, 0)  # every ref given back
    cache._manager._index.check_invariants()


def test_a_chain_t1_cannot_hold_whole_keeps_its_head_in_t1_and_drops_its_tail(
    clock: FakeClock,
) -> None:
    kv = pool(11)
    cache = bound(kv, clock, t1=2)
    a = prompt(4, 1)
    run_sequence(cache, kv, a, 1)
    reference = cache.read_blocks(cache.block_hashes(make_key(), a[:32]))
    assert reference is not None
    assert cache.set_t0_enabled(False) == (2, 2)  # root first: the head fits, the tail goes
    assert used(cache) == (0, 2)
    hit = cache.lookup(make_key(), [*a, 9])
    assert isinstance(hit, Hit) and hit.tier is Tier.T1 and hit.matched_tokens == 32
    k, v = cache.materialize(hit)
    assert torch.equal(k, reference[0]) and torch.equal(v, reference[1])
    cache.release(hit)
    assert (kv.refs.num_free, kv.num_cached_blocks) == (11, 0)
    cache._manager._index.check_invariants()


def test_t0_off_on_a_cache_that_serves_alone_demotes_through_the_same_path(
    clock: FakeClock,
) -> None:
    from kvfleet_runtime.cache import CacheTuning, PrefixCache
    from tests.runtime.cache.test_t0_pool import LAYOUT

    cache = PrefixCache(CacheTuning(num_t0_blocks=4, num_t1_blocks=4, admit_min_sightings=1,
                                    hot_min_sightings=1), LAYOUT, clock=clock)
    tokens = prompt(2, 5)
    g = torch.Generator().manual_seed(5)
    k = torch.randn((2, 4, 32, 8), generator=g)
    v = torch.randn((2, 4, 32, 8), generator=g)
    cache.store(make_key(), tokens, k, v)
    cache.drain_store_queue()
    assert used(cache) == (2, 0)  # hot (pinned) placement: T0
    assert cache.set_t0_enabled(False) == (2, 0)
    assert used(cache) == (0, 2)
    hit = cache.lookup(make_key(), tokens)
    assert isinstance(hit, Hit) and hit.tier is Tier.T1
    out_k, out_v = cache.materialize(hit)  # no promotion while off
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    cache.release(hit)
    assert used(cache) == (0, 2)
    cache._manager._index.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "finish", "t0", "drain"]), st.integers(0, 5),
                          st.lists(st.integers(0, 2), min_size=1, max_size=3), st.booleans()),
                min_size=1, max_size=40))
def test_t0_toggling_under_running_sequences_never_shows_wrong_data_or_leaks_a_block(
    ops: list[tuple[str, int, list[int], bool]],
) -> None:
    """As the shared-pool property test (tests/runtime/cache/test_t0_pool.py), with T0 turned on
    and off at random between sequence starts and finishes on a 10-block pool with a 4-block T1:
    a running sequence's blocks keep its own KV, whatever the cache hands out is the KV of exactly
    those tokens, nothing lives in T0 while it is off, and every block comes back at the end."""
    kv = pool(10)
    cache = bound(kv, FakeClock(), t1=4)
    key = make_key()
    running: list[tuple[list[int], list[int], Hit | None]] = []
    for op, pick, pattern, on in ops:
        if op == "start":
            started = start_checked(cache, kv, key, pattern)
            if started is None:
                continue
            running.append(started)
        elif op == "finish" and running:
            tokens, table, held = running.pop(pick % len(running))
            kv.give_back(table)
            if held:
                cache.release(held)
        elif op == "t0":
            cache.set_t0_enabled(on)
        elif op == "drain":
            cache.drain_store_queue()
        for tokens, table, _ in running:
            for b, block_id in enumerate(table):
                assert kv.refs.ref_count(block_id) >= 1
                assert kv.k[0, block_id, 0, 0, 0].item() == _expected(tokens, b)
        if not cache.t0_enabled:
            assert all(n.tier != Tier.T0 for n in cache._manager._index.nodes())
        cache._manager._index.check_invariants([n for _, _, h in running if h for n in h._path])
    for _, table, held in running:
        kv.give_back(table)
        if held:
            cache.release(held)
    cache.drain_store_queue()
    for pattern in itertools.chain.from_iterable(
        itertools.product(range(3), repeat=n) for n in (1, 2, 3)
    ):
        tokens = [t * 100 + i for t in pattern for i in range(BLOCK_SIZE)]
        for b, h in enumerate(cache.block_hashes(key, tokens)):
            got = cache.read_blocks([h])
            if got is not None:
                assert got[0][0, 0, 0, 0].item() == _expected(tokens, b)
                assert got[1][0, 0, 0, 0].item() == -_expected(tokens, b)
    assert kv.num_free_blocks == kv.num_blocks
    cache.set_t0_enabled(False)
    assert (kv.refs.num_free, kv.num_cached_blocks) == (10, 0)  # every block back to the engine
