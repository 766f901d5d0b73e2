"""What Belady keeps that a policy drops: lost blocks and what came between their uses."""

from __future__ import annotations

import pytest

from kvfleet_lab.cache.compare import compare_workload
from kvfleet_lab.cache.explain import explain_lost_hits, simulate_lru_returning_only
from kvfleet_lab.cache.sim import TraceRequest, simulate_belady, simulate_lru
from kvfleet_runtime.cache import BlockHash


def req(*blocks: int) -> TraceRequest:
    return TraceRequest(
        0.0, 16 * len(blocks), tuple(BlockHash(b.to_bytes(16, "little")) for b in blocks)
    )


def test_one_shots_between_the_reuses_of_a_prefix_are_what_lru_loses_to() -> None:
    # A = [1 2] every other request, a one-shot pair between: LRU at 2 blocks hits nothing,
    # Belady keeps A (it bypasses the one-shots) and hits it at requests 2, 4 and 6.
    trace = [req(1, 2), req(10, 11), req(1, 2), req(20, 21), req(1, 2), req(30, 31), req(1, 2)]
    lost = explain_lost_hits(trace, simulate_lru(trace, 2), simulate_belady(trace, 2))
    assert (lost.num_lost_blocks, lost.num_gained_blocks) == (6, 0)
    assert lost.num_first_reuse_blocks == 2  # request 2's: A's second sighting
    # Between each two uses of A: one pair, both first sightings, both once-seen: 1 capacity.
    assert lost.accesses_quartiles == lost.new_quartiles == lost.once_quartiles == (1, 1, 1)
    assert lost.returning_quartiles == (0, 0, 0)
    assert lost.once_share_of_new == 1.0
    assert lost.share_returning_below_capacity == 1.0 and lost.share_new_below_capacity == 0.0
    # LRU that stores no one-shot keeps A as Belady does.
    assert lost.returning_only_lru_hit_blocks == 6


def test_lru_storing_only_returning_blocks_neither_stores_nor_refreshes_a_last_use() -> None:
    # At 1 block: [1] stored (it returns), [2] not (never again); [1]'s last use does not
    # refresh it, so [3], which returns, replaces it; [3] hits.
    trace = [req(1), req(2), req(1), req(3), req(3)]
    assert simulate_lru_returning_only(trace, 1).hit_blocks == [0, 0, 1, 0, 1]
    assert simulate_lru(trace, 1).hit_blocks == [0, 0, 0, 0, 1]


def test_returning_blocks_and_resent_blocks_count_apart() -> None:
    # B = [5] comes back later, so it is a returning first sighting between A's uses; [9] is
    # once-seen; A itself re-sent in between (request 2) counts as requested, not as new.
    trace = [req(1), req(5), req(1), req(9), req(1), req(5)]
    lru = simulate_lru(trace, 1)
    belady = simulate_belady(trace, 1)
    assert lru.hit_blocks == [0, 0, 0, 0, 0, 0] and belady.hit_blocks == [0, 0, 1, 0, 1, 0]
    lost = explain_lost_hits(trace, lru, belady)
    # Request 2 (A's 2nd use): [5] between, new and returning. Request 4: [9] between, once-seen.
    assert lost.num_lost_blocks == 2 and lost.num_first_reuse_blocks == 1
    assert sorted([lost.returning_quartiles[0], lost.returning_quartiles[2]]) == [0.0, 1.0]
    assert lost.once_share_of_new == 0.5
    assert lost.share_returning_below_capacity == 0.5


def test_results_of_another_capacity_or_trace_are_refused() -> None:
    trace = [req(1), req(1)]
    with pytest.raises(ValueError, match="same capacity"):
        explain_lost_hits(trace, simulate_lru(trace, 1), simulate_belady(trace, 2))
    with pytest.raises(ValueError, match="trace of 1"):
        explain_lost_hits(trace[:1], simulate_lru(trace, 1), simulate_belady(trace, 1))


def test_the_comparison_explains_each_row_from_its_own_replays() -> None:
    trace = [req(1, 2), req(10, 11), req(1, 2), req(20, 21), req(1, 2), req(30, 31), req(1, 2)]
    result = compare_workload("tiny", "test", trace, [0.25, 0.5], explain=True)
    for row in result.rows:
        lost = row.lost_hits
        assert lost is not None and lost.capacity_blocks == row.capacity_blocks
        belady, kvfleet = row.figures["belady"], row.figures["kvfleet"]
        assert lost.num_lost_blocks - lost.num_gained_blocks == (
            belady.num_hit_tokens - kvfleet.num_hit_tokens
        ) // 16
    assert compare_workload("tiny", "test", trace, [0.5]).rows[0].lost_hits is None
