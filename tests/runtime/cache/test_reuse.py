"""The reuse-time ranking on tiny pools with exact orders: `ReuseEviction` (credit = last use +
horizon x log2(sightings), the horizon learned from its own victims, the duel), its ghost, and
its place among the ghosts' rankings."""

from __future__ import annotations

import pytest

from kvfleet_runtime.cache import CacheManager, CacheTuning
from kvfleet_runtime.cache._admission import Admission, ThrashDetector
from kvfleet_runtime.cache._block_index import BlockIndex, BlockNode
from kvfleet_runtime.cache._eviction import floors
from kvfleet_runtime.cache._ghosts import AdaptiveRanking, GhostRanking, ghost_rankings
from kvfleet_runtime.cache._moves import Tier
from kvfleet_runtime.cache._reuse import HORIZON_WEIGHT, GhostReuse, Horizon, ReuseEviction
from kvfleet_runtime.cache._sketch import CountMinSketch
from tests.runtime.cache.conftest import make_key
from tests.runtime.cache.test_block_index import h
from tests.runtime.cache.test_eviction import always, drain, nodes


def test_with_no_horizon_yet_it_is_plain_lru() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("abcde", counts, {"a": 8, "c": 3})
    policy = ReuseEviction(counts)
    for node in reversed(list(blocks.values())):
        policy.push(node, always)
    assert policy.horizon.ticks == 0.0
    assert drain(policy) == "abcde"  # what a cache that has evicted nothing yet knows


@pytest.mark.parametrize(
    ("horizon", "order"),
    [
        # credits (int): a 1 + 3h (8 sightings), b 2, c 3 + 1.58h, d 4, e 5 + h (2 sightings)
        (1.0, "bacde"),  # a 4, b 2, c 4, d 4, e 6: equal credits go by last use
        (2.0, "bdcae"),  # a 7, c 6, e 7
        (10.0, "bdeca"),  # frequency dominates: a 31, c 18, e 15
    ],
)
def test_victims_go_by_least_credit(horizon: float, order: str) -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("abcde", counts, {"a": 8, "c": 3, "e": 2})
    policy = ReuseEviction(counts)
    policy.horizon.ticks = horizon
    for node in blocks.values():
        policy.push(node, always)
    assert drain(policy) == order


def test_the_horizon_is_the_ewma_of_the_victims_age() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("abc", counts, {})
    blocks["c"].last_tick = 101  # the newest block the policy saw: "now" is tick 101
    policy = ReuseEviction(counts)
    for node in blocks.values():
        policy.push(node, always)
    assert policy.horizon.now == 101
    assert policy.pop(0, always) is blocks["a"]  # age 100
    first = 100 * HORIZON_WEIGHT
    assert policy.horizon.ticks == pytest.approx(first)
    assert policy.pop(0, always) is blocks["b"]  # age 99
    assert policy.horizon.ticks == pytest.approx(first + (99 - first) * HORIZON_WEIGHT)


def test_the_duel_refuses_a_newcomer_with_less_credit_than_its_victim() -> None:
    counts = CountMinSketch(width=1024)
    blocks = nodes("v", counts, {"v": 16})  # v: tick 1, 16 sightings
    counts.increment(h("new"))  # one sighting
    for _ in range(32):
        counts.increment(h("hot"))
    policy = ReuseEviction(counts)
    policy.push(blocks["v"], always)
    policy.horizon.now = 10
    policy.horizon.ticks = 3.0
    # newcomers enter at tick 11: "new" credit 11, "hot" 11 + 3 * 5 = 26; v: 1 + 3 * 4 = 13
    assert policy.candidate_weights([h("new"), h("hot")]) == [11, 26]
    assert policy.outranks(blocks["v"], 11) is True  # the one-shot block is bypassed
    assert policy.outranks(blocks["v"], 26) is False
    policy.horizon.ticks = 2.0  # v's credit 9 ran out before "now": any newcomer takes it
    assert policy.outranks(blocks["v"], policy.candidate_weights([h("new")])[0]) is False


def test_in_the_index_it_picks_exact_victims_on_a_four_block_pool() -> None:
    counts = CountMinSketch(width=1024)
    policy = ReuseEviction(counts)
    index = BlockIndex((4, 0), policy)
    ns = index.namespace(make_key())

    def store(*names: str) -> list[BlockNode]:
        hashes = [h(n) for n in names]
        counts.increment_many(hashes)
        got, _ = index.insert(ns, None, hashes[:1], tier=Tier.T0, pinned=False)
        index.release(got)
        return got

    for name in ("a", "b", "c", "d"):
        store(name)
    for _ in range(7):
        counts.increment(h("a"))  # a: 8 sightings, the oldest block
    store("e")  # horizon 0 until now: LRU takes a
    assert index.get(h("a")) is None
    assert policy.horizon.ticks > 0
    policy.horizon.ticks = 1.0
    for _ in range(15):
        counts.increment(h("b"))  # b: 16 sightings -> credit tick(b) + 4
    b = index.get(h("b"))
    assert b is not None
    b.floor = floors([16], counts.num_resets)[0]  # what a store's sighting of b sets
    store("f")  # credits b 2 + 4 = 6 (its entry is re-ranked on pop), c 3, d 4, e 5: c goes
    assert [index.get(h(n)) is not None for n in "bcdef"] == [True, False, True, True, True]
    index.check_invariants()


def test_its_ghost_matches_then_holds_the_most_credited_blocks() -> None:
    ghost = GhostReuse(3)
    ghost.horizon.ticks = 4.0
    assert ghost.replay([h("a"), h("b")], [1, 1]) == 0  # tick 1, credit 1
    assert ghost.replay([h("a"), h("b")], [2, 2]) == 2  # the leading run it held; credit 6
    assert ghost.replay([h("x"), h("y")], [1, 1]) == 0  # tick 3, credit 3: one of x, y goes
    assert len(ghost) == 3
    assert ghost.replay([h("a"), h("b")], [3, 3]) == 2  # a and b outlasted the newcomers
    assert ghost.replay([h("y")], [2]) == 1  # equal credits: the smaller hash went, x
    assert ghost.replay([h("x")], [2]) == 0


def test_a_sampled_ghost_keeps_its_share_and_scales_its_hits() -> None:
    ghost = GhostReuse(8, sample=2)
    even = [bytes([i]) * 16 for i in range(0, 8, 2)]
    assert ghost.limit == 4
    ghost.replay(even, [1] * len(even))
    assert ghost.replay(even, [2] * len(even)) == 8


def test_the_factory_builds_one_ghost_per_ranking_and_rejects_unknown_names() -> None:
    ghosts = ghost_rankings(100, (1, None, "reuse"), sample=1)
    assert [type(g) for g in ghosts] == [GhostRanking, GhostRanking, GhostReuse]
    assert [g.label for g in ghosts] == ["recency", "count", "reuse"]
    with pytest.raises(ValueError, match="got 'lfu'"):
        ghost_rankings(100, (1, "lfu"))
    with pytest.raises(ValueError, match="eviction_rankings must be"):
        CacheTuning(num_t0_blocks=8, eviction_rankings=(1, "lfu"))


def test_admission_hands_out_the_reuse_ranking_when_its_ghost_leads() -> None:
    sketch = CountMinSketch(width=1024)
    ranking = AdaptiveRanking(ghost_rankings(4, (1, "reuse")), decay=0.99, margin=0.0)
    admission = Admission(
        sketch, ranking, ThrashDetector(0.9, 10.0, 30.0, 1), admit_min_sightings=1
    )
    assert ranking.label == "recency"
    ranking.current = 1
    assert ranking.label == "reuse" and ranking.strict
    assert isinstance(admission.eviction(), ReuseEviction)


def test_a_manager_following_it_reports_it_and_keeps_its_invariants() -> None:
    now = [0.0]
    manager = CacheManager(
        CacheTuning(num_t0_blocks=6, eviction_rankings=("reuse",)),
        bytes_per_block=16,
        clock=lambda: now[0],
    )
    key = make_key()
    hits = []
    for i in range(40):
        now[0] = float(i)
        hot = [h("s0"), h("s1")]
        chain = [*hot, h(f"u{i}"), h(f"v{i}")] if i % 2 else [h(f"w{i}"), h(f"z{i}")]
        hits.append(manager.replay(key, chain, 16 * len(chain)))
        manager._index.check_invariants()
    assert manager.stats().eviction_ranking == "reuse"
    assert sum(hits) >= 2 * 18  # the shared head stays through the one-shot chains


def test_horizon_key_saturates_at_the_sketch_counter_limit() -> None:
    horizon = Horizon()
    horizon.ticks = 1.0
    assert horizon.key(5, 255) == horizon.key(5, 1000) == 5 + 7
