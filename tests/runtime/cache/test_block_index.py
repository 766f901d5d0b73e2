"""The radix index and tier accounting on tiny pools, with exact block ids and eviction order."""

from __future__ import annotations

import random

import pytest

from kvfleet_runtime.cache import BlockHash, Tier
from kvfleet_runtime.cache._allocator import (
    BlockAllocator,
    BlockRefs,
    CachedSlots,
    contiguous_runs,
    paired_runs,
)
from kvfleet_runtime.cache._block_index import BlockIndex, BlockNode, Move, Namespace
from kvfleet_runtime.cache._eviction import RankedEviction
from kvfleet_runtime.cache._sketch import CountMinSketch
from tests.runtime.cache.conftest import DIGEST_A, DIGEST_B, make_key


def h(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(16, b"."))


def chain(prefix: str, n: int) -> list[BlockHash]:
    return [h(f"{prefix}{i}") for i in range(n)]


def make_index(
    t0: int, t1: int = 0, *, max_frequency: int | None = None, pin_limit: int = 0
) -> tuple[BlockIndex, Namespace]:
    policy = RankedEviction(CountMinSketch(width=1024), max_frequency=max_frequency)
    index = BlockIndex((t0, t1), policy, pin_limit=pin_limit)
    return index, index.namespace(make_key())


def sketch(index: BlockIndex) -> CountMinSketch:
    """The sketch the index's eviction policy ranks by (the tests count sightings into it)."""
    policy = index.policy
    assert isinstance(policy, RankedEviction)
    return policy.sketch


def put(
    index: BlockIndex,
    ns: Namespace,
    hashes: list[BlockHash],
    tier: Tier = Tier.T0,
    pinned: bool = False,
) -> list[BlockNode]:
    """Insert the part of `hashes` not yet indexed, then drop the write refs."""
    resident = index.match(hashes)
    nodes, _ = index.insert(
        ns, resident[-1] if resident else None, hashes[len(resident) :], tier=tier, pinned=pinned
    )
    index.release(nodes)
    index.check_invariants()
    return nodes


def test_allocator_hands_out_lowest_ids_and_refuses_without_room() -> None:
    alloc = BlockAllocator(4)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) is None and alloc.num_free == 1
    alloc.free([1])
    assert alloc.allocate(2) == [1, 3]
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([1, 1])


def test_runs() -> None:
    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert paired_runs([3, 4, 5, 6], [0, 1, 7, 8]) == [(3, 0, 2), (5, 7, 2)]
    assert paired_runs([], []) == []


def test_match_returns_the_longest_indexed_prefix_only() -> None:
    index, ns = make_index(8)
    put(index, ns, chain("a", 3))
    assert [n.block_hash for n in index.match(chain("a", 5))] == chain("a", 3)
    # Not a prefix: a chain starting elsewhere matches nothing even if later hashes exist.
    assert index.match([h("zz"), *chain("a", 3)]) == []
    assert index.match(chain("a", 3)[1:]) == []


def test_lru_leaf_first_eviction_order_on_a_four_block_pool() -> None:
    index, ns = make_index(4)
    a = put(index, ns, chain("a", 2))  # ids 0, 1
    b = put(index, ns, chain("b", 2))  # ids 2, 3
    assert [n.block_id for n in a + b] == [0, 1, 2, 3]
    index.touch(index.match(chain("a", 2)))  # a is now more recent than b
    c = put(index, ns, chain("c", 2))
    # b's leaf goes first, then b's root (now a leaf); the interior block never before its child.
    assert [n.block_id for n in c] == [3, 2]
    assert index.match(chain("b", 2)) == [] and len(index.match(chain("a", 2))) == 2


def test_referenced_blocks_are_never_evicted_and_not_enough_room_is_partial() -> None:
    index, ns = make_index(3)
    put(index, ns, chain("a", 3))
    held = index.match(chain("a", 3))
    index.acquire(held)
    nodes, _ = index.insert(ns, None, chain("b", 2), tier=Tier.T0, pinned=False)
    assert nodes == []  # everything is referenced: nothing to evict, nothing written
    index.release(held)
    nodes, _ = index.insert(ns, None, chain("b", 2), tier=Tier.T0, pinned=False)
    index.release(nodes)
    assert [n.block_id for n in nodes] == [2, 1]
    index.check_invariants()


def test_frequency_duel_keeps_frequent_blocks_against_a_colder_newcomer() -> None:
    index, ns = make_index(2)
    hot = chain("hot", 2)
    for _ in range(5):
        for x in hot:
            sketch(index).increment(x)
    put(index, ns, hot)
    cold = chain("cold", 2)
    sketch(index).increment(cold[0])
    nodes, _ = index.insert(ns, None, cold, tier=Tier.T0, pinned=False)
    assert nodes == [] and len(index.match(hot)) == 2


def test_unpinned_blocks_are_evicted_before_pinned_ones() -> None:
    index, ns = make_index(4, pin_limit=2)
    put(index, ns, chain("p", 2), pinned=True)  # ids 0, 1
    put(index, ns, chain("u", 2))  # ids 2, 3, more recent than p
    assert index.num_pinned == 2
    nodes = put(index, ns, chain("n", 2))
    assert [n.block_id for n in nodes] == [3, 2]
    assert len(index.match(chain("p", 2))) == 2


def test_pin_limit_caps_pinned_blocks() -> None:
    index, ns = make_index(4, pin_limit=1)
    nodes = put(index, ns, chain("p", 2), pinned=True)
    assert index.num_pinned == 0 and not any(n.pinned for n in nodes)


def test_t0_eviction_demotes_to_t1_and_a_hit_promotes_back() -> None:
    index, ns = make_index(2, 2)
    put(index, ns, chain("a", 2))  # T0 ids 0, 1
    for x in chain("b", 2):
        sketch(index).increment(x)
    nodes, plan = index.insert(ns, None, chain("b", 2), tier=Tier.T0, pinned=False)
    index.release(nodes)
    # a's leaf then a's root were demoted (T1 ids 0 then 1): their data moves before b lands.
    assert plan.moves == [Move(Tier.T0, 1, Tier.T1, 0), Move(Tier.T0, 0, Tier.T1, 1)]
    a = index.match(chain("a", 2))
    assert [(n.tier, n.block_id) for n in a] == [(Tier.T1, 1), (Tier.T1, 0)]
    index.check_invariants()
    index.acquire(a)
    for x in chain("a", 2):
        sketch(index).increment(x)
        sketch(index).increment(x)
    plan = index.promote(a)
    # b could not be demoted (T1 is full of a's referenced blocks): b's leaf (T0 id 0) and then
    # b's root (id 1) were dropped, and a moved into those slots.
    assert [(n.tier, n.block_id) for n in a] == [(Tier.T0, 0), (Tier.T0, 1)]
    assert plan.moves == [Move(Tier.T1, 1, Tier.T0, 0), Move(Tier.T1, 0, Tier.T0, 1)]
    assert [n.block_hash for n in plan.dropped] == [chain("b", 2)[1], chain("b", 2)[0]]
    index.release(a)
    index.check_invariants()


def test_a_new_block_below_a_t1_parent_goes_to_t1() -> None:
    index, ns = make_index(2, 4)
    parent = put(index, ns, chain("a", 1), tier=Tier.T1)
    nodes, _ = index.insert(ns, parent[0], chain("a", 2)[1:], tier=Tier.T0, pinned=True)
    index.release(nodes)
    assert nodes[0].tier == Tier.T1 and not nodes[0].pinned
    index.check_invariants()


def test_invalidate_unindexes_now_and_frees_held_blocks_at_release() -> None:
    index, ns = make_index(4)
    other = index.namespace(make_key(digest=DIGEST_B))
    put(index, ns, chain("a", 2))
    put(index, other, chain("b", 1))
    held = index.match(chain("a", 2))
    index.acquire(held)
    removed, freed = index.invalidate(DIGEST_A)
    assert removed == 2 and freed == []
    assert index.match(chain("a", 2)) == [] and len(index.match(chain("b", 1))) == 1
    assert index.allocators[Tier.T0].num_used == 3
    index.check_invariants(held)
    assert len(index.release(held)) == 2
    assert index.allocators[Tier.T0].num_used == 1
    index.check_invariants()


@pytest.mark.parametrize(("max_frequency", "survivor"), [(None, "old"), (2, "new")])
def test_frequencies_above_the_cap_rank_alike_so_recency_decides(
    max_frequency: int | None, survivor: str
) -> None:
    index, ns = make_index(2, max_frequency=max_frequency)
    old, new = chain("old", 1), chain("new", 1)
    for _ in range(5):  # popular once, then never again
        sketch(index).increment(old[0])
    put(index, ns, old)
    for _ in range(2):
        sketch(index).increment(new[0])
    put(index, ns, new)
    for _ in range(2):
        sketch(index).increment(chain("x", 1)[0])
    put(index, ns, chain("x", 1))  # needs a victim: the least frequent, least recent among equals
    gone = "new" if survivor == "old" else "old"
    assert len(index.match(chain(survivor, 1))) == 1 and index.match(chain(gone, 1)) == []
    assert len(index.match(chain("x", 1))) == 1


class _PushThenPop:
    """`RankedEviction` without its `push_pop`: the index falls back to a push and a pop."""

    def __init__(self, inner: RankedEviction) -> None:
        self.inner = inner
        self.push = inner.push
        self.pop = inner.pop
        self.candidate_weights = inner.candidate_weights
        self.outranks = inner.outranks
        self.fill = inner.fill


def _engine_index(
    num_blocks: int, max_frequency: int | None, *, push_pop: bool
) -> tuple[BlockIndex, BlockRefs, CountMinSketch]:
    refs = BlockRefs(num_blocks)
    sk = CountMinSketch(width=64)
    ranked = RankedEviction(sk, max_frequency=max_frequency)
    policy = ranked if push_pop else _PushThenPop(ranked)
    index = BlockIndex((num_blocks, 0), policy, pin_limit=3, t0_slots=CachedSlots(refs))
    return index, refs, sk


def _drive(
    index: BlockIndex, refs: BlockRefs, sk: CountMinSketch, seed: int, reclaim: str
) -> list[object]:
    """A random replica's life on a 24-block engine pool: prompts stored in place (branching
    chains, some pinned), hits that touch, refs and sequence holds that outlast a reclaim, and
    reclaims of random size by `reclaim` ("reclaim" or the per-victim "_reclaim_demoting").
    Returns what each reclaim dropped, and the final state."""
    rng = random.Random(seed)
    ns = index.namespace(make_key())
    held: list[list[BlockNode]] = []
    seq_held: list[list[int]] = []
    seen: list[object] = []

    def hashes_of(c: int, b: int, p: int, n: int) -> list[BlockHash]:
        return [h(f"{c}.{i}") if i < p else h(f"{c}.{b}.{p}.{i}") for i in range(n)]

    for _ in range(60):
        op = rng.random()
        c, b, p, n = rng.randrange(4), rng.randrange(2), rng.randrange(4), rng.randrange(1, 7)
        hashes = hashes_of(c, b, p, n)
        if op < 0.45:
            sk.increment_many(hashes)
            resident = index.match(hashes)
            new = hashes[len(resident):]
            ids = refs.allocate(len(new)) if new else None
            if ids is None:
                continue
            nodes = index.adopt(ns, resident[-1] if resident else None, new, ids,
                                pinned=rng.random() < 0.2)
            index.release(nodes)
            if rng.random() < 0.3:
                seq_held.append(ids)  # the sequence still runs: in use, not reclaimable
            else:
                refs.release(ids)
        elif op < 0.6:
            index.touch(index.match(hashes))
        elif op < 0.7:
            path = index.match(hashes)
            index.acquire(path)
            held.append(path)
        elif op < 0.8 and (held or seq_held):
            if held and rng.random() < 0.5:
                index.release(held.pop(rng.randrange(len(held))))
            elif seq_held:
                refs.release(seq_held.pop(rng.randrange(len(seq_held))))
        else:
            plan = getattr(index, reclaim)(rng.randrange(1, 25))
            seen.append(([n.block_hash for n in plan.dropped], plan.dropped_from, plan.moves))
        index.check_invariants()
    seen.append((sorted(refs._free), index.num_pinned, index.counters[Tier.T0].num_evictions,
                 sorted(n.block_hash for n in index.nodes())))
    return seen


@pytest.mark.parametrize("max_frequency", [1, 2, None])
@pytest.mark.parametrize("push_pop", [True, False])
def test_the_batched_reclaim_drops_what_one_victim_at_a_time_drops(
    max_frequency: int | None, push_pop: bool
) -> None:
    """`reclaim` without T1 (one loop, `push_pop`, slots freed in one batch) evicts the same
    blocks in the same order as the per-victim loop (pop, `_evict`, the parent pushed)."""
    for seed in range(40):
        got = _drive(*_engine_index(24, max_frequency, push_pop=push_pop), seed, "reclaim")
        want = _drive(*_engine_index(24, max_frequency, push_pop=False), seed,
                      "_reclaim_demoting")
        assert got == want, f"seed {seed}"
        assert any(step[0] for step in got[:-1]), f"seed {seed}: nothing reclaimed"  # type: ignore[index]
