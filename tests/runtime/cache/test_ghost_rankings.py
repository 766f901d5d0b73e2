"""The eviction-ranking policy on tiny pools: ghost directories with exact contents, the ranking
the adaptive policy follows, and the index re-ranked when it switches."""

from __future__ import annotations

import pytest

from kvfleet_runtime.cache import CacheTuning
from kvfleet_runtime.cache._block_index import BlockIndex
from kvfleet_runtime.cache._eviction import RankedEviction
from kvfleet_runtime.cache._ghosts import AdaptiveRanking, GhostRanking
from kvfleet_runtime.cache._manager import CacheManager, StorePlan
from kvfleet_runtime.cache._sketch import CountMinSketch
from tests.runtime.cache.conftest import make_key
from tests.runtime.cache.test_block_index import chain, h, put


def held(ghost: GhostRanking, names: str) -> list[str]:
    return [n for n in names if ghost.match([h(n)]) == 1]


def test_recency_ghost_is_lru_with_the_chain_head_most_recent() -> None:
    ghost = GhostRanking(3, 1)
    ghost.offer([h("a"), h("b")], [1, 1])
    ghost.offer([h("c")], [1])
    assert held(ghost, "abcd") == ["a", "b", "c"]
    ghost.offer([h("d")], [1])  # b went in before a (tail first): b is the least recent
    assert held(ghost, "abcd") == ["a", "c", "d"]
    assert ghost.match([h("a"), h("c"), h("b"), h("d")]) == 2  # a leading run only


def test_count_ghost_evicts_the_lowest_capped_class_first() -> None:
    capped, raw = GhostRanking(2, 2), GhostRanking(2, None)
    for ghost in (capped, raw):
        ghost.offer([h("a")], [5])
        ghost.offer([h("b")], [3])
        ghost.offer([h("c")], [2])
    # Capped at 2 the three are alike: recency drops a. Raw counts drop c, the least seen.
    assert held(capped, "abc") == ["b", "c"]
    assert held(raw, "abc") == ["a", "b"]
    capped.offer([h("d")], [1])  # class 1 goes first even though it is the newest
    assert held(capped, "bcd") == ["b", "c"]


def test_a_sampled_ghost_keeps_only_its_share_of_the_hash_space() -> None:
    ghost = GhostRanking(8, 1, sample=4)
    ids = [bytes([i]) * 16 for i in range(16)]  # last byte i: sampled when i % 4 == 0
    ghost.offer(ids, [1] * 16)
    assert len(ghost) == 2  # 8 // 4 blocks: the most recent sampled ones (the head: 0 and 4)
    assert ghost.match(ids) == 2 * 4  # 0 and 4 held, 8 not: two sampled blocks, scaled by 4
    with pytest.raises(ValueError, match="power of two"):
        GhostRanking(8, 1, sample=3)


def test_adaptive_ranking_follows_the_ghost_that_hit_most_with_hysteresis() -> None:
    ranking = AdaptiveRanking(
        [GhostRanking(2, 1), GhostRanking(2, None)], decay=0.5, margin=0.25
    )
    assert ranking.max_frequency == 1 and not ranking.strict
    hot = [h("hot")]
    switched = []
    for i in range(4):  # a hot block between one-shots: LRU's ghost loses it every time
        switched.append(ranking.observe(hot, [i + 1], 0))
        switched.append(ranking.observe([h(f"x{i}"), h(f"y{i}")], [1, 1], 0))
    # Seen once, "hot" is as cold as a one-shot and both ghosts drop it. Seen twice, it outranks
    # the one-shots in the count ghost, which hits it at its third sighting and takes over (1
    # vs 0); LRU's ghost never hits it.
    assert switched == [False, False, False, False, True, False, False, False]
    assert ranking.max_frequency is None and ranking.strict and ranking.current == 1
    assert ranking.scores[0] == 0.0 and ranking.num_switches == 1
    assert ranking.num_ghost_hit_blocks == 1  # the fourth sighting, under the count ranking


def test_index_re_ranks_every_evictable_block_when_the_cap_drops() -> None:
    counts = CountMinSketch(width=1024)
    index = BlockIndex((2, 0), RankedEviction(counts, max_frequency=None))
    ns = index.namespace(make_key())
    old, new = chain("old", 1), chain("new", 1)
    for _ in range(5):
        counts.increment(old[0])
    put(index, ns, old)
    counts.increment(new[0])
    put(index, ns, new)
    # Plain recency: "old" is the least recent, it goes.
    index.set_policy(RankedEviction(counts, max_frequency=1))
    counts.increment(h("x"))
    put(index, ns, [h("x")])
    assert index.match(old) == [] and len(index.match(new)) == 1


def test_manager_switches_to_a_count_ranking_where_lru_would_lose_the_hot_prefix() -> None:
    config = CacheTuning(num_t0_blocks=4, ranking_decay=0.5, ranking_margin=0.0)
    manager = CacheManager(config, bytes_per_block=1, clock=lambda: 0.0)
    key = make_key()
    hot = chain("hot", 2)
    assert manager.stats().eviction_ranking == "recency"
    for i in range(3):
        plan = manager.plan_store(key, hot)
        if isinstance(plan, StorePlan):
            manager.finish_commit(manager.commit(plan))
        for j in range(2):
            plan = manager.plan_store(key, chain(f"once{i}{j}-", 2))
            assert isinstance(plan, StorePlan)  # first sightings are admitted
            manager.finish_commit(manager.commit(plan))
    stats = manager.stats()
    assert stats.eviction_ranking != "recency" and stats.strictness > 0
    assert stats.num_ranking_switches == 1
    assert stats.totals.num_first_sighting_admissions == 2 + 3 * 2 * 2
    assert len(manager._index.match(hot)) == 2  # the hot prefix survived the last one-shots
    manager._index.check_invariants()


def test_a_store_counts_the_resident_blocks_at_their_sighting() -> None:
    """The ranking's count of a cached block is set at each sighting (`BlockNode.floor`),
    bounded by the chain: "b" over-counted in the sketch still counts as often as "a"."""
    manager = CacheManager(CacheTuning(num_t0_blocks=4), bytes_per_block=1, clock=lambda: 0.0)
    key = make_key()
    ab = [h("a"), h("b")]
    manager._sketch.increment(h("b"))  # a colliding block's sighting
    for sighting in (1, 2, 3):
        plan = manager.plan_store(key, ab)
        if isinstance(plan, StorePlan):
            manager.finish_commit(manager.commit(plan))
        assert [n.floor & 0xFF for n in manager._index.match(ab)] == [sighting, sighting]
    assert manager._sketch.estimate(h("b")) == 4


def test_config_rejects_bad_rankings() -> None:
    with pytest.raises(ValueError, match="eviction_rankings"):
        CacheTuning(num_t0_blocks=4, eviction_rankings=())
    with pytest.raises(ValueError, match="eviction_rankings"):
        CacheTuning(num_t0_blocks=4, eviction_rankings=(0,))
    with pytest.raises(ValueError, match="ranking_decay"):
        CacheTuning(num_t0_blocks=4, ranking_decay=1.0)


class _OrderedGhost:
    """The ghost's ranking spelled out a block at a time, one ordered dict per class: the
    reference the whole-chain replay must match."""

    def __init__(self, limit: int, max_frequency: int | None) -> None:
        self.limit = limit
        self.classes: list[dict[bytes, None]] = [{} for _ in range(max_frequency or 255)]
        self.where: dict[bytes, int] = {}

    def replay(self, hashes: list[bytes], counts: list[int]) -> int:
        top = len(self.classes)
        first_absent = len(hashes)
        for i in range(len(hashes) - 1, -1, -1):
            block, count = hashes[i], counts[i]
            k = (count if count < top else top) - 1 if count > 1 else 0
            old = self.where.get(block)
            if old is None:
                first_absent = i
            else:
                del self.classes[old][block]
            self.classes[k][block] = None  # a dict keeps insertion order: the end is the newest
            self.where[block] = k
        while len(self.where) > self.limit:
            victim = next(iter(next(c for c in self.classes if c)))
            del self.classes[self.where.pop(victim)][victim]
        return first_absent


@pytest.mark.parametrize("max_frequency", [1, 2, 6, None])
def test_the_whole_chain_replay_keeps_the_block_at_a_time_ranking(
    max_frequency: int | None,
) -> None:
    """Misses (chains new to the ghost), repeated hits in one class, chains whose blocks change
    class, repeated hashes: the same matches, and the same blocks held, in the same order of
    eviction, as the ranking replayed a block at a time."""
    import random

    rng = random.Random(max_frequency or 0)
    ghost = GhostRanking(40, max_frequency)
    reference = _OrderedGhost(40, max_frequency)
    pool = [rng.randbytes(16) for _ in range(120)]
    seen: dict[bytes, int] = {}
    for _ in range(3000):
        if rng.random() < 0.3:
            hashes = [rng.randbytes(16) for _ in range(rng.randrange(0, 30))]
        else:
            hashes = rng.sample(pool, rng.randrange(1, 30))
            if rng.random() < 0.05:
                hashes.insert(rng.randrange(len(hashes)), rng.choice(hashes))
        counts = []
        for block in hashes:
            seen[block] = seen.get(block, 0) + rng.choice([0, 1, 1, 3])
            counts.append(max(1, seen[block]))
        if rng.random() < 0.4:
            counts = [counts[0]] * len(counts) if counts else []
        assert ghost.replay(hashes, counts) == reference.replay(hashes, counts)
        assert len(ghost) == len(reference.where)
        probe = rng.sample(pool, 10)
        assert [ghost.match([b]) for b in probe] == [int(b in reference.where) for b in probe]
