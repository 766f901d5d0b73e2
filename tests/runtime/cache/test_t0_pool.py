"""T0 is the engine's KV: one ref-counted block pool shared by sequences and the cache, on an
11-block pool with exact block ids (no model: sequences are simulated by taking blocks, writing
them and giving them back, which is all the engine does with the pool)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    CacheKey,
    CacheTuning,
    Hit,
    KVLayout,
    PagedBlocks,
    PrefixCache,
    StoreOutcome,
    Tier,
)
from kvfleet_runtime.cache import _cache as cache_module
from kvfleet_runtime.cache._allocator import BlockRefs, paired_runs
from kvfleet_runtime.cache._pool import copy_runs
from tests.runtime.cache.conftest import DIGEST_A, FakeClock, make_key

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32")


def pool(num_blocks: int = 11) -> PagedBlocks:
    return PagedBlocks.zeros(LAYOUT, num_blocks, torch.device("cpu"))


def bound(kv: PagedBlocks, clock: FakeClock, t1: int = 0, **kw: object) -> PrefixCache:
    return PrefixCache(
        CacheTuning(num_t0_blocks=kv.num_blocks, num_t1_blocks=t1, **kw),  # type: ignore[arg-type]
        LAYOUT,
        clock=clock,
        device_kv=kv,
    )


def compute(kv: PagedBlocks, table: list[int], seed: int) -> None:
    """What prefill does: write the sequence's KV into its own blocks."""
    g = torch.Generator().manual_seed(seed)
    for b in table:
        kv.k[:, b] = torch.randn(kv.k[:, b].shape, generator=g)
        kv.v[:, b] = torch.randn(kv.v[:, b].shape, generator=g)


def prompt(n_blocks: int, seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(n_blocks * BLOCK_SIZE)]


def run_sequence(cache: PrefixCache, kv: PagedBlocks, tokens: list[int], seed: int) -> list[int]:
    """A miss: take blocks, compute, store in place, finish. Returns the table."""
    table = kv.take(len(tokens) // BLOCK_SIZE)
    assert table is not None
    compute(kv, table, seed)
    assert cache._store_blocks(make_key(), tokens, kv, table) is StoreOutcome.STORED
    kv.give_back(table)
    return table


def test_a_store_indexes_the_blocks_in_place_and_a_hit_shares_the_same_ids(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = pool()
    cache = bound(kv, clock)
    assert cache.device_kv is kv
    copies: list[int] = []
    monkeypatch.setattr(cache_module, "copy_runs", lambda *a: copies.append(1) or 1)
    tokens = prompt(3, seed=1)
    table = run_sequence(cache, kv, tokens, seed=1)
    assert table == [0, 1, 2]
    snapshot = kv.k[:, table].clone()
    # Cached, not doubled: the 3 blocks are the cache's now, and still count as room.
    assert (kv.refs.num_free, kv.num_cached_blocks, kv.num_free_blocks) == (8, 3, 11)
    assert cache.stats().tiers[0].num_blocks_used == 3

    hit = cache.lookup(make_key(), tokens + [7] * 5)
    assert isinstance(hit, Hit) and hit.tier is Tier.T0
    shared = cache._share_prefix(hit, kv, 3)
    assert shared == [0, 1, 2]  # the same blocks, by id
    assert [kv.refs.ref_count(b) for b in shared] == [1, 1, 1]
    fresh = kv.take(1)
    assert fresh == [3] and kv.refs.num_free == 7  # only the unmatched block was allocated
    assert copies == []  # no copy: a T0 hit is block ids in the table
    assert torch.equal(kv.k[:, shared], snapshot)
    kv.give_back(shared + fresh)
    cache.release(hit)
    assert (kv.refs.num_free, kv.num_cached_blocks, kv.refs.num_cache_only) == (8, 3, 3)
    cache._manager._index.check_invariants()


def test_reclaim_under_in_flight_pressure_follows_the_victim_order(clock: FakeClock) -> None:
    kv = pool()
    cache = bound(kv, clock)
    a, b, c = prompt(2, 1), prompt(2, 2), prompt(2, 3)
    assert run_sequence(cache, kv, a, 1) == [0, 1]
    assert run_sequence(cache, kv, b, 2) == [2, 3]
    assert run_sequence(cache, kv, c, 3) == [4, 5]
    hit = cache.lookup(make_key(), a)  # A becomes the most recent
    assert isinstance(hit, Hit)
    cache.release(hit)
    removed: list[int] = []
    cache.add_listener(lambda e: removed.extend([len(e.block_hashes)]) if e.kind == "removed"
                       else None)
    # 5 free (6..10) and 6 cached: 8 blocks need 3 cached ones back, leaf first, oldest first:
    # B's tail, then B's head (a leaf now), then C's tail.
    table = kv.take(8)
    assert table == [2, 3, 5, 6, 7, 8, 9, 10]
    assert sum(removed) == 3
    assert cache._manager.num_cached_blocks(cache.block_hashes(make_key(), a)) == 2
    assert cache._manager.num_cached_blocks(cache.block_hashes(make_key(), b)) == 0
    assert cache._manager.num_cached_blocks(cache.block_hashes(make_key(), c)) == 1
    # Two more: C's head (a leaf now, older) before A's tail (the hit made it recent).
    more = kv.take(2)
    assert more == [1, 4]
    assert cache._manager.num_cached_blocks(cache.block_hashes(make_key(), a)) == 1
    assert kv.take(2) is None  # only A's head could be given back: nothing is evicted in vain
    assert cache._manager.num_cached_blocks(cache.block_hashes(make_key(), a)) == 1
    kv.give_back(table + more)
    cache._manager._index.check_invariants()


def test_a_block_shared_by_a_running_sequence_is_never_reclaimed(clock: FakeClock) -> None:
    kv = pool(4)
    cache = bound(kv, clock)
    tokens = prompt(2, 5)
    table = kv.take(2)
    assert table == [0, 1]
    compute(kv, table, 5)
    before = kv.k[:, table].clone()
    assert cache._store_blocks(make_key(), tokens, kv, table) is StoreOutcome.STORED
    # The sequence still holds both blocks (decoding): cached, but no room to give back.
    assert (kv.num_cached_blocks, kv.refs.num_cache_only, kv.num_free_blocks) == (2, 0, 2)
    assert kv.take(3) is None
    assert cache._manager.num_cached_blocks(cache.block_hashes(make_key(), tokens)) == 2
    got = kv.take(2)
    assert got == [2, 3]
    compute(kv, got, 6)
    assert torch.equal(kv.k[:, table], before)  # nobody wrote the shared blocks
    kv.give_back(table)  # the sequence finishes: the blocks are the cache's alone
    assert (kv.refs.num_free, kv.refs.num_cache_only) == (0, 2)
    kv.give_back(got)
    assert kv.take(4) == [0, 1, 2, 3]  # now reclaimable
    assert cache._manager.num_cached_blocks(cache.block_hashes(make_key(), tokens)) == 0
    cache._manager._index.check_invariants()


def test_reclaim_demotes_to_t1_then_a_t1_hit_copies_one_run_into_engine_blocks(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = pool(8)
    cache = bound(kv, clock, t1=8)
    tokens = prompt(4, 7)
    run_sequence(cache, kv, tokens, 7)
    reference = cache.read_blocks(cache.block_hashes(make_key(), tokens))
    assert reference is not None
    hog = kv.take(8)  # in-flight work takes the whole pool: the prefix is demoted, not lost
    assert hog is not None
    stats = cache.stats()
    assert (stats.tiers[0].num_demotions, stats.tiers[1].num_blocks_used) == (4, 4)
    kv.give_back(hog)

    hit = cache.lookup(make_key(), [*tokens, 1])
    assert isinstance(hit, Hit) and hit.tier is Tier.T1
    assert cache._share_prefix(hit, kv, 4) == []
    t1_ids = [n.block_id for n in hit._path]
    table = kv.take(5)
    assert table is not None
    counted: list[int] = []
    original = cache_module.copy_runs

    def spy(*args: object) -> int:
        n = original(*args)  # type: ignore[arg-type]
        counted.append(n)
        return n

    monkeypatch.setattr(cache_module, "copy_runs", spy)
    num_copies = cache._copy_into(hit, kv, table, 0, 4)
    # Demoted in chain order (not leaf first), into one run: the 4-block hit is one copy.
    assert t1_ids == [0, 1, 2, 3] and table[:4] == [0, 1, 2, 3]
    assert num_copies == len(paired_runs(t1_ids, table[:4])) == sum(counted) == 1
    got = cache.read_blocks(cache.block_hashes(make_key(), tokens))
    assert got is not None
    assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
    # Promoted where the copy landed: the next hit is T0, in this sequence's blocks.
    again = cache.lookup(make_key(), [*tokens, 1])
    assert isinstance(again, Hit) and again.tier is Tier.T0
    assert cache._share_prefix(again, kv, 4) == table[:4]
    kv.give_back(table[:4])
    cache.release(again)
    kv.give_back(table)
    cache.release(hit)
    assert cache.stats().tiers[1].num_promotions == 4
    cache._manager._index.check_invariants()


def test_invalidate_makes_shared_blocks_unreachable_and_frees_them_at_the_end(
    clock: FakeClock,
) -> None:
    kv = pool(6)
    cache = bound(kv, clock)
    tokens = prompt(2, 9)
    run_sequence(cache, kv, tokens, 9)
    hit = cache.lookup(make_key(), [*tokens, 3])
    assert isinstance(hit, Hit)
    shared = cache._share_prefix(hit, kv, 2)
    assert cache.invalidate(DIGEST_A) == 2
    assert not isinstance(cache.lookup(make_key(), [*tokens, 3]), Hit)
    assert kv.refs.num_free == 4  # still read by the sequence
    cache.release(hit)
    kv.give_back(shared)
    assert (kv.refs.num_free, kv.num_cached_blocks) == (6, 0)
    cache._manager._index.check_invariants()


def test_peers_read_t0_blocks_in_the_canonical_layout(clock: FakeClock) -> None:
    kv = pool(4)
    cache = bound(kv, clock)
    tokens = prompt(2, 4)
    table = run_sequence(cache, kv, tokens, 4)
    got = cache.read_blocks(cache.block_hashes(make_key(), tokens))
    assert got is not None
    k, _ = got  # [layers, heads, tokens, head_dim]
    for i, b in enumerate(table):
        assert torch.equal(k[:, :, i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], kv.k[:, b])
    other = bound(pool(4), clock)
    assert other._import_blocks(make_key(), tokens, *got) == 2
    again = other.read_blocks(other.block_hashes(make_key(), tokens))
    assert again is not None and torch.equal(again[0], k)


def test_device_kv_must_match_the_layout_and_the_t0_size(clock: FakeClock) -> None:
    kv = pool(4)
    with pytest.raises(ValueError, match="num_t0_blocks must equal its 4 blocks, got 5"):
        PrefixCache(CacheTuning(num_t0_blocks=5), LAYOUT, clock=clock, device_kv=kv)
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    with pytest.raises(ValueError, match="device_kv: k must be"):
        PrefixCache(CacheTuning(num_t0_blocks=4), other, clock=clock, device_kv=kv)
    bound(kv, clock)
    with pytest.raises(ValueError, match="another PrefixCache"):
        bound(kv, clock)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "share", "give", "cache", "uncache"]),
                          st.integers(0, 5)), max_size=60))
def test_block_refs_never_free_a_held_block(ops: list[tuple[str, int]]) -> None:
    refs = BlockRefs(6)
    users: list[int] = []  # one entry per user ref
    cached: set[int] = set()
    for op, i in ops:
        if op == "take":
            got = refs.allocate(1)
            if got:
                assert got[0] not in users and got[0] not in cached
                users.extend(got)
        elif op == "share" and (i in users or i in cached):
            refs.share([i])
            users.append(i)
        elif op == "give" and i in users:
            refs.release([i])
            users.remove(i)
        elif op == "cache" and i in users and i not in cached:
            refs.cache([i])
            cached.add(i)
        elif op == "uncache" and i in cached:
            refs.uncache([i])
            cached.discard(i)
        held = set(users) | cached
        assert refs.num_free == 6 - len(held)
        assert all(not refs.is_free(b) for b in held)
        assert refs.num_cached == len(cached)
        assert refs.num_cache_only == len(cached - set(users))


def _expected(tokens: list[int], block: int) -> float:
    """Fake KV that depends on the whole prefix, as real KV does (a block's value names it)."""
    return float(hash(tuple(tokens[: (block + 1) * BLOCK_SIZE])) % 997 + 1)


def _fill(kv: PagedBlocks, block_id: int, value: float) -> None:
    kv.k[:, block_id] = value
    kv.v[:, block_id] = -value


def start_checked(cache: PrefixCache, kv: PagedBlocks, key: CacheKey, pattern: list[int]
                  ) -> tuple[list[int], list[int], Hit | None] | None:
    """The engine's request path step by step (lookup, share the T0 head, take fresh blocks,
    copy the rest of the hit, compute, store in place) for a prompt of `pattern`'s blocks plus a
    2-token tail, checking on the way that what the cache gave is this prompt's KV and that the
    sequence computes only its own blocks. (tokens, table, hit held), or None when the pool has
    no room (every ref given back)."""
    tokens = [t * 100 + i for t in pattern for i in range(BLOCK_SIZE)] + [9, 9]
    n_blocks = len(pattern)
    hit = cache.lookup(key, tokens)
    held = hit if isinstance(hit, Hit) else None
    usable = min(len(held.blocks), n_blocks) if held else 0
    shared = cache._share_prefix(held, kv, usable) if held else []
    fresh = kv.take(n_blocks + 1 - len(shared))
    if fresh is None:
        kv.give_back(shared)
        if held:
            cache.release(held)
        return None
    table = shared + fresh
    if held:
        cache._copy_into(held, kv, table, len(shared), usable)
    for b in range(usable):  # what the cache gave is this prompt's KV
        assert kv.k[0, table[b], 0, 0, 0].item() == _expected(tokens, b)
    for b in range(usable, n_blocks + 1):  # the sequence computes only its own blocks
        assert kv.refs.ref_count(table[b]) == 1 and not kv.refs.is_cached(table[b])
        _fill(kv, table[b], _expected(tokens, b))
    cache._store_blocks(key, tokens[: n_blocks * BLOCK_SIZE], kv, table)
    return tokens, table, held


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.lists(st.integers(0, 2),
                                                                       min_size=1, max_size=3)),
                min_size=1, max_size=40))
def test_sequences_and_the_cache_sharing_one_pool_never_see_wrong_data(
    ops: list[tuple[bool, int, list[int]]],
) -> None:
    """Random starts (lookup, share, take, copy, compute, store in place) and finishes on a
    10-block pool with a 4-block T1: every sequence's blocks keep its own KV while it runs, and
    every block the cache returns is the KV of exactly those tokens."""
    kv = pool(10)
    cache = bound(kv, FakeClock(), t1=4)
    key = make_key()
    running: list[tuple[list[int], list[int], Hit | None]] = []
    for start, pick, pattern in ops:
        if start:
            started = start_checked(cache, kv, key, pattern)
            if started is None:
                continue
            running.append(started)
        elif running:
            tokens, table, held = running.pop(pick % len(running))
            kv.give_back(table)
            if held:
                cache.release(held)
        for tokens, table, _ in running:
            for b, block_id in enumerate(table):
                assert kv.refs.ref_count(block_id) >= 1
                assert kv.k[0, block_id, 0, 0, 0].item() == _expected(tokens, b)
        cache._manager._index.check_invariants()
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
            if got is not None:  # whatever is cached is the KV of exactly these tokens
                assert got[0][0, 0, 0, 0].item() == _expected(tokens, b)
                assert got[1][0, 0, 0, 0].item() == -_expected(tokens, b)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_block_demoted_by_a_reclaim_is_not_evicted_by_the_same_reclaim(
    clock: FakeClock,
) -> None:
    """Reclaiming two blocks into a one-block T1: the first victim is demoted into T1's only
    slot; the second must not evict it from there before the demotion's copy has run (the
    eviction sink would get that slot's old bytes under the first block's hash, and both
    demotions would target one slot). Found by the property test below."""
    kv = pool(4)
    cache = bound(kv, clock, t1=1)
    runs: list[tuple[tuple[bytes, ...], torch.Tensor]] = []
    cache.set_eviction_sink(lambda run: runs.append((run.block_hashes, run.k.clone())))
    a, b = prompt(1, 1), prompt(1, 2)
    run_sequence(cache, kv, a, 1)
    run_sequence(cache, kv, b, 2)
    data = {h: kv.k[:, block].clone() for h, block in
            ((cache.block_hashes(make_key(), a)[0], 0), (cache.block_hashes(make_key(), b)[0], 1))}
    table = kv.take(4)  # the whole pool: both cached blocks must go
    assert table == [0, 1, 2, 3]
    for hashes, k in runs:  # whatever reached the sink is the KV of exactly that block
        assert torch.equal(k, data[hashes[0]])  # canonical [layers, heads, 16, D] = kv.k[:, b]
    kept = [h for h in data if cache.read_blocks([h]) is not None]
    assert len(kept) == 1  # one demoted into T1's slot, the other dropped
    got = cache.read_blocks(kept)
    assert got is not None and torch.equal(got[0], data[kept[0]])
    kv.give_back(table)
    cache._manager._index.check_invariants()



def _evicting_miss(cache: PrefixCache, kv: PagedBlocks) -> list[tuple[object, ...]]:
    """A hot pinned chain of another tenant, then a miss that evicts it: every field of every
    indexed node (the parent by its hash)."""
    old_key = make_key("tenant-b")
    old = prompt(5, seed=1)
    sketch = cache._manager._sketch
    for _ in range(2):  # seen twice before: its store is the third sighting, which pins it
        sketch.increment_many(cache.block_hashes(old_key, old))
    table = kv.take(5)
    assert table is not None
    assert cache._store_blocks(old_key, old, kv, table) is StoreOutcome.STORED
    kv.give_back(table)
    run_sequence(cache, kv, prompt(8, seed=3), seed=3)  # 6 blocks free: 2 of the old go
    return sorted(
        (n.block_hash, n.parent.block_hash if n.parent else None, n.namespace.key, n.tier,
         n.block_id, n.num_children, n.num_t0_children, n.ref_count, n.last_tick, n.pinned,
         n.floor)
        for n in cache._manager._index.nodes()
    )


def test_an_evicting_miss_files_its_chain_in_the_nodes_it_dropped_set_anew(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = pool()
    cache = bound(kv, clock)
    index = cache._manager._index
    created: list[object] = []
    recycle = index.recycle
    monkeypatch.setattr(index, "recycle", lambda dropped: (created.extend(dropped),
                                                           recycle(dropped)))
    got = _evicting_miss(cache, kv)
    assert len(created) == 2 and all(any(n is m for m in index.nodes()) for n in created)
    assert any(row[9] for row in got)  # the old chain's pinned rest is still there
    index.check_invariants()
    # The same steps on a cache that never re-uses a node: the same index, field by field.
    twin_kv = pool()
    twin = bound(twin_kv, FakeClock())
    monkeypatch.setattr(twin._manager._index, "recycle", lambda dropped: None)
    assert _evicting_miss(twin, twin_kv) == got


def test_with_an_eviction_sink_the_dropped_nodes_are_not_re_used(clock: FakeClock) -> None:
    kv = pool()
    cache = bound(kv, clock)
    runs: list[object] = []
    cache.set_eviction_sink(runs.append)
    old = prompt(5, seed=1)
    run_sequence(cache, kv, old, seed=1)
    old_nodes = [cache._manager._index.get(h) for h in cache.block_hashes(make_key(), old)]
    new = prompt(8, seed=3)
    run_sequence(cache, kv, new, seed=3)
    new_nodes = [cache._manager._index.get(h) for h in cache.block_hashes(make_key(), new)]
    assert not {id(n) for n in new_nodes} & {id(n) for n in old_nodes}
    assert runs  # the sink got the old chain's blocks, read from the nodes it kept
    cache._manager._index.check_invariants()


class _CopyCalls(TorchDispatchMode):
    """Counts the copy kernels torch runs (one per `copy_` call)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.copy_.default:
            self.num_copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("paired_src", [True, False])
def test_a_run_between_pools_copies_k_and_v_in_one_call_where_both_are_one_tensor(
    paired_src: bool,
) -> None:
    # K and V of a pool lie in one allocation (`kv`): a run of blocks between two such pools is
    # one copy call (two calls ran at 0.85x a raw copy of the same bytes). A pool whose K and V
    # are apart still gets the right bytes, by two calls.
    shape = (LAYOUT.num_layers, 6, LAYOUT.num_kv_heads, BLOCK_SIZE, LAYOUT.head_dim)
    g = torch.Generator().manual_seed(3)
    if paired_src:
        src = pool(6)
        src.k.copy_(torch.randn(shape, generator=g))
        src.v.copy_(torch.randn(shape, generator=g))
    else:
        src = PagedBlocks(k=torch.randn(shape, generator=g), v=torch.randn(shape, generator=g),
                          refs=BlockRefs(6))
    dst = pool(8)
    assert dst.kv is not None and (src.kv is not None) is paired_src
    calls = _CopyCalls()
    with calls:
        num_runs = copy_runs(src, [1, 2, 3, 5], dst, [4, 5, 6, 0])
    assert num_runs == 2 and calls.num_copies == (2 if paired_src else 4)
    for s, d in ((1, 4), (2, 5), (3, 6), (5, 0)):
        assert torch.equal(dst.k[:, d], src.k[:, s]) and torch.equal(dst.v[:, d], src.v[:, s])
    assert not dst.k[:, [1, 2, 3, 7]].any() and not dst.v[:, [1, 2, 3, 7]].any()


def test_a_hit_listener_sees_each_prepared_hits_blocks_and_cannot_fail_it(
    clock: FakeClock,
) -> None:
    """What keeps a fleet's hints of blocks in use alive (the fleet tier's refresh): every hit
    `prepare` finds, with its exact blocks; a miss says nothing, and a listener that raises
    costs the request nothing (the hit is placed, its refs are released at finish)."""
    kv = pool()
    cache = bound(kv, clock)
    tokens = prompt(3, seed=1)
    run_sequence(cache, kv, tokens, seed=1)
    seen: list[tuple[str, tuple[bytes, ...]]] = []

    def failing(key: CacheKey, blocks: tuple[bytes, ...]) -> None:
        raise RuntimeError("the hint index is down")

    cache.add_hit_listener(lambda key, blocks: seen.append((key.tenant_id, blocks)))
    cache.add_hit_listener(failing)
    miss = cache.prepare(make_key(), prompt(2, seed=9), kv)
    assert seen == [] and miss.hit is None
    cache.finish(miss)
    prefix = cache.prepare(make_key(), [*tokens, 7], kv)
    assert seen == [(make_key().tenant_id, tuple(cache.block_hashes(make_key(), tokens)))]
    assert prefix.table == [0, 1, 2]
    kv.give_back(prefix.table)
    cache.finish(prefix)
    assert (kv.refs.num_free, kv.refs.num_cache_only) == (8, 3)
