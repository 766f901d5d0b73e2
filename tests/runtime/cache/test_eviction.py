"""The policy classes on their own, on tiny pools with exact orders: `RankedEviction` (victim
order and the duel, one instance per ranking) and `Admission` (first sighting, tightening under
thrash only when the ranking counts reuse, the ghosts' choice handed to the index)."""

from __future__ import annotations

import pytest

from kvfleet_runtime.cache._admission import Admission, ThrashDetector
from kvfleet_runtime.cache._block_index import BlockNode, Namespace
from kvfleet_runtime.cache._eviction import RankedEviction, floors
from kvfleet_runtime.cache._ghosts import AdaptiveRanking, GhostRanking
from kvfleet_runtime.cache._sketch import CountMinSketch
from tests.runtime.cache.conftest import make_key
from tests.runtime.cache.test_block_index import h


def always(node: BlockNode) -> bool:
    return True


def nodes(names: str, counts: CountMinSketch, sightings: dict[str, int]) -> dict[str, BlockNode]:
    """One T0 block per name, last used in name order (tick 1, 2, ...), seen as `sightings` says
    (once by default)."""
    ns = Namespace(make_key())
    out = {}
    for tick, name in enumerate(names, start=1):
        for _ in range(sightings.get(name, 1)):
            counts.increment(h(name))
        out[name] = BlockNode(h(name), None, ns, 0, tick - 1, last_tick=tick)
    return out


def drain(policy: RankedEviction, tier: int = 0) -> str:
    """Pop every victim, as the index would: a popped block is evicted, so it is no longer
    evictable (a second entry of it is skipped)."""
    order: list[BlockNode] = []
    while (node := policy.pop(tier, lambda n: n not in order)) is not None:
        order.append(node)
    return "".join(n.block_hash.rstrip(b".").decode() for n in order)


@pytest.mark.parametrize(
    ("max_frequency", "order"),
    [
        (1, "abcde"),  # plain LRU: counts do not matter
        (2, "bdace"),  # b, d seen once go first; a, c, e (2, 3, 5 sightings) rank alike, by age
        (None, "bdace"),  # raw counts: 1, 1, 2, 3, 5
    ],
)
def test_victim_order_per_cap(max_frequency: int | None, order: str) -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("abcde", counts, {"a": 2, "c": 3, "e": 5})
    policy = RankedEviction(counts, max_frequency=max_frequency)
    for node in reversed(list(blocks.values())):  # push order must not matter, recency does
        policy.push(node, always)
    assert drain(policy) == order


def test_pinned_blocks_go_last_and_stale_entries_are_skipped() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("abcd", counts, {})
    policy = RankedEviction(counts, max_frequency=1)
    blocks["a"].pinned = True
    for node in blocks.values():
        policy.push(node, always)
    blocks["b"].last_tick = 9  # touched after its push: the entry is stale, the block not queued
    policy.push(blocks["c"], always)  # pushed twice: evicted once
    assert drain(policy) == "cda"
    assert policy.pop(0, always) is None  # the drain used up every entry


def test_pop_asks_the_index_what_is_evictable_and_tiers_queue_apart() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("abc", counts, {})
    blocks["c"].tier = 1
    policy = RankedEviction(counts, max_frequency=1)
    for node in blocks.values():
        policy.push(node, always)
    held = blocks["a"]
    first = policy.pop(0, lambda n: n is not held)
    assert first is blocks["b"] and policy.pop(0, always) is None  # a's entry was dropped
    assert policy.pop(1, always) is blocks["c"]


def test_the_duel_refuses_a_colder_newcomer_unless_the_cap_makes_them_alike() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("v", counts, {"v": 4})
    counts.increment(h("new"))
    for cap, weight, refused in [(None, 1, True), (None, 4, False), (2, 1, True), (1, 1, False)]:
        policy = RankedEviction(counts, max_frequency=cap)
        assert policy.candidate_weights([h("v"), h("new")]) == [4 if cap is None else cap, 1]
        assert policy.outranks(blocks["v"], weight) is refused
        assert policy.candidate_weights([h("v")]) == [min(4, cap or 4)]


@pytest.mark.parametrize("cap", [2, None])
def test_a_block_counts_no_more_sightings_than_its_parent(cap: int | None) -> None:
    """The sketch over-counts (here: "leaf" counted twice, as a colliding block would make it
    read); a chain hash commits to its prefix, so the parent's count bounds it. Unbounded, the
    leaf of a chain seen once outranks a newcomer seen once (refused) and is evicted after a
    more recent block seen once ("other"), keeping the chain above it."""
    counts = CountMinSketch(width=1024)
    ns = Namespace(make_key())
    counts.increment(h("root"))
    counts.increment(h("leaf"))
    counts.increment(h("leaf"))  # the over-count
    root = BlockNode(h("root"), None, ns, 0, 0, last_tick=2)
    leaf = BlockNode(h("leaf"), root, ns, 0, 1, last_tick=1)
    other = nodes("o", counts, {})["o"]
    other.last_tick = 3
    policy = RankedEviction(counts, max_frequency=cap)
    assert policy.candidate_weights([h("root"), h("leaf")]) == [1, 1]
    assert not policy.outranks(leaf, 1)
    for node in (other, leaf):
        policy.push(node, always)
    assert drain(policy) == "leafo"  # least recent first: both count once
    admission = make_admission((1,))
    assert admission.count([h("root"), h("leaf")], 0.0) == [1, 1]
    admission.sketch.increment(h("leaf"))
    assert admission.count([h("root"), h("leaf")], 0.0) == [2, 2]


@pytest.mark.parametrize("cap", [2, None])
def test_a_block_ranks_by_its_count_at_its_last_sighting(cap: int | None) -> None:
    """Counted once when stored (its floor, this epoch), "old" then reads 3 in the sketch
    without being seen (other blocks sharing its counters): it still ranks as seen once, so it
    goes before the more recent "new" and does not outrank a newcomer seen once. A floor from
    before the sketch's last aging does not count: the sketch is asked again."""
    counts = CountMinSketch(width=1024)
    blocks = nodes("ab", counts, {})
    old, new = blocks["a"], blocks["b"]
    old.floor, new.floor = floors([1, 1], counts.num_resets)
    counts.increment(h("a"))
    counts.increment(h("a"))
    policy = RankedEviction(counts, max_frequency=cap)
    assert not policy.outranks(old, 1)
    for node in (new, old):
        policy.push(node, always)
    assert drain(policy) == "ab"
    old.floor = floors([1], counts.num_resets - 1)[0]  # an epoch ago
    assert policy.outranks(old, 1)


def test_fill_ranks_every_block_now() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("abc", counts, {})
    policy = RankedEviction(counts, max_frequency=None)
    for node in blocks.values():
        policy.push(node, always)
    for _ in range(3):
        counts.increment(h("a"))
    blocks["a"].floor = floors([4], counts.num_resets)[0]  # seen 3 more times: a store sets it
    fresh = RankedEviction(counts, max_frequency=None)
    fresh.fill(0, blocks.values())
    assert drain(fresh) == "bca"


def test_queues_compact_their_stale_entries() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("ab", counts, {})
    policy = RankedEviction(counts, max_frequency=1)
    for tick in range(3000):  # every touch leaves the old entries stale
        blocks["a"].last_tick = tick + 10
        policy.push(blocks["a"], always)
    assert policy.num_queued(0) <= 1025
    policy.push(blocks["b"], always)
    assert drain(policy) == "ba"


def make_admission(
    caps: tuple[int | None, ...] = (1,), *, admit_min_sightings: int = 1
) -> Admission:
    thrash = ThrashDetector(ratio=0.9, window_s=1.0, sustain_s=2.0, min_blocks=1)
    ranking = AdaptiveRanking([GhostRanking(4, cap) for cap in caps], decay=0.5, margin=0.0)
    return Admission(
        CountMinSketch(width=1024), ranking, thrash, admit_min_sightings=admit_min_sightings
    )


def thrash(admission: Admission) -> None:
    """Drive the detector into thrashing: every block offered is dropped, for 3 windows."""
    for t in range(4):
        admission.note_dropped(10, float(t))
        admission.count([h(f"t{t}")], float(t))
    assert admission.thrash.thrashing


def test_admission_takes_first_sightings_and_counts_what_it_refuses() -> None:
    admission = make_admission(admit_min_sightings=1)
    chain = [h("a"), h("b"), h("c")]
    counts = admission.count(chain, 0.0)
    got = admission.decide(chain, counts, 0)
    assert (got.num_blocks, got.num_first_sightings, got.num_refused) == (3, 3, 0)
    strict = make_admission(admit_min_sightings=2)
    strict.count(chain[:1], 0.0)
    counts = strict.count(chain, 0.0)
    assert counts == [2, 1, 1]
    got = strict.decide(chain, counts, 0)
    assert (got.num_blocks, got.num_first_sightings, got.num_refused) == (1, 0, 2)
    got = strict.decide(chain, strict.count(chain, 0.0), 1)  # [3, 2, 2], one block resident
    assert (got.num_blocks, got.num_first_sightings, got.num_refused) == (3, 0, 0)


@pytest.mark.parametrize(("caps", "tightened"), [((1,), False), ((None,), True)])
def test_thrash_tightens_admission_only_under_a_ranking_that_counts_reuse(
    caps: tuple[int | None, ...], tightened: bool
) -> None:
    admission = make_admission(caps)
    thrash(admission)
    chain = [h("x")]
    got = admission.decide(chain, admission.count(chain, 4.0), 0)
    assert got.thrashing is tightened and admission.thrashing is tightened
    assert got.num_blocks == (0 if tightened else 1)
    assert admission.eviction().max_frequency == caps[0]


def test_admission_reports_the_ghosts_switch_and_hands_out_the_new_ranking() -> None:
    admission = make_admission((1, None))
    hot = [h("hot")]
    changed = []
    for i in range(3):  # as in test_policy: the count ghost keeps "hot" between one-shots
        changed.append(admission.decide(hot, admission.count(hot, 0.0), 0).ranking_changed)
        once = [h(f"x{i}"), h(f"y{i}"), h(f"z{i}"), h(f"w{i}")]
        changed.append(admission.decide(once, admission.count(once, 0.0), 0).ranking_changed)
    assert changed == [False, False, False, False, True, False]
    assert admission.eviction().max_frequency is None


def test_admission_rejects_a_zero_threshold() -> None:
    with pytest.raises(ValueError, match="admit_min_sightings must be >= 1, got 0"):
        make_admission(admit_min_sightings=0)
