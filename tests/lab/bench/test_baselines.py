"""The two baselines of `kvfleet bench policies`, exactly: vLLM-style hash + LRU and SGLang-style
radix + LRU on tiny hand-made traces (exact hits, exact evictions), and Belady and the infinite
cache bounding every online policy on random traces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet_lab.cache.sim import (
    TraceRequest,
    simulate_belady,
    simulate_infinite,
    simulate_kvfleet,
    simulate_lru,
    simulate_radix,
    simulate_vllm,
)
from kvfleet_runtime.cache import BLOCK_SIZE, BlockHash, CacheTuning


def h(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "little"))


def req(*blocks: int, extra_tokens: int = 5) -> TraceRequest:
    """A request of these chain hashes plus a partial tail (so no block is held back)."""
    return TraceRequest(0.0, BLOCK_SIZE * len(blocks) + extra_tokens, tuple(map(h, blocks)))


def chain(prefix: tuple[int, ...], *tail: int) -> tuple[int, ...]:
    return prefix + tail


def test_vllm_evicts_one_block_where_radix_evicts_a_whole_leaf() -> None:
    # 4 blocks. A=(1,2,3) leaves one free block, B=(5) takes it. C=(6) needs one block:
    # vLLM pops the least recently freed block, A's tail (3) — A was freed tail first — while
    # the radix tree drops its least recently used leaf, the whole segment (1,2,3).
    trace = [req(1, 2, 3), req(5), req(6), req(1, 2)]
    vllm = simulate_vllm(trace, 4)
    radix = simulate_radix(trace, 4)
    assert vllm.num_hit_tokens == 2 * BLOCK_SIZE and vllm.extra["evictions"] == 1
    assert radix.num_hit_tokens == 0 and radix.extra["evictions"] == 3
    # Plain block LRU (the colleague's `simulate_lru`) agrees with vLLM, block for block.
    assert simulate_lru(trace, 4).num_hit_tokens == vllm.num_hit_tokens


def test_radix_evicts_the_whole_allocation_not_the_shortfall() -> None:
    # 4 blocks, three one-block leaves, one free. D=(4,5) needs 2 with 1 free: SGLang's
    # alloc_token_slots calls evict(2), which drops the two oldest leaves (1 and 2); vLLM
    # evicts exactly one block (1), so E=(2) still hits there.
    trace = [req(1), req(2), req(3), req(4, 5), req(2)]
    vllm = simulate_vllm(trace, 4)
    radix = simulate_radix(trace, 4)
    assert vllm.num_hit_tokens == BLOCK_SIZE and vllm.extra["evictions"] == 1
    assert radix.num_hit_tokens == 0 and radix.extra["evictions"] == 2


def test_radix_refreshes_a_shared_prefix_with_its_branch() -> None:
    # A=(1,2,3) then B=(1,2,4): the radix tree splits A at (1,2) and the match refreshes the
    # whole path, so the oldest leaf is A's remainder (3); vLLM's free queue after B is
    # [3, 4, 2, 1] (B freed tail first), so it also drops 3 first. With room for 4 blocks,
    # C=(7) evicts one block in both, and D=(1,2,4) hits 3 blocks in both.
    trace = [req(1, 2, 3), req(1, 2, 4), req(7), req(1, 2, 4)]
    assert simulate_vllm(trace, 4).num_hit_tokens == (2 + 3) * BLOCK_SIZE
    assert simulate_radix(trace, 4).num_hit_tokens == (2 + 3) * BLOCK_SIZE
    # One block less: C needs a block with none free. vLLM drops 3 only; the radix tree drops
    # the leaf (3) and then, still at evict(1) >= 1, stops: the same hits.
    assert simulate_vllm(trace, 3).num_hit_tokens == 2 * BLOCK_SIZE + 2 * BLOCK_SIZE
    assert simulate_radix(trace, 3).num_hit_tokens == 2 * BLOCK_SIZE + 2 * BLOCK_SIZE


def test_vllm_keeps_duplicates_when_the_last_token_is_recomputed() -> None:
    # A 32-token prompt of 2 full blocks: with `max_cache_hit_length = num_tokens - 1` a
    # repeat hits only block 1 and fills block 2 again into a second copy of the same hash
    # (BlockPool does not de-duplicate); the radix tree frees the duplicate at insert.
    a = TraceRequest(0.0, 2 * BLOCK_SIZE, (h(1), h(2)))
    vllm = simulate_vllm([a, a, a], 3, recompute_last_token=True)
    assert vllm.num_hit_tokens == 2 * BLOCK_SIZE
    # The second A fills a free block: copy 2 of block 2 (free queue: copy 1, copy 2, block 1).
    # The third pops the least recently freed block, copy 1, evicts it and fills it again while
    # copy 2 still holds the hash: a duplicate again.
    assert vllm.extra["duplicate_blocks"] == 2 and vllm.extra["evictions"] == 1
    radix = simulate_radix([a, a, a], 3, recompute_last_token=True)
    assert radix.num_hit_tokens == 2 * BLOCK_SIZE
    # Off (the comparison's accounting), both hit the whole prompt from the second request on.
    assert simulate_vllm([a, a, a], 3).num_hit_tokens == 4 * BLOCK_SIZE
    assert simulate_radix([a, a, a], 3).num_hit_tokens == 4 * BLOCK_SIZE


def test_a_request_larger_than_the_cache_stores_what_fits() -> None:
    big = req(*range(1, 11))
    for simulate in (simulate_vllm, simulate_radix):
        result = simulate([big, big], 4)
        assert result.num_hit_tokens == 4 * BLOCK_SIZE, simulate.__name__


def test_capacity_must_be_positive() -> None:
    import pytest

    for simulate in (simulate_vllm, simulate_radix):
        with pytest.raises(ValueError, match="capacity_blocks"):
            simulate([req(1)], 0)


# -- random traces -------------------------------------------------------------------------

_prefix = st.lists(st.integers(1, 40), min_size=1, max_size=6)


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRequest]:
    """Requests over a few shared prefix trees: chains of small ids, so branches share heads."""
    roots = draw(st.lists(_prefix, min_size=1, max_size=5))
    out = []
    for _ in range(draw(st.integers(1, 40))):
        root = roots[draw(st.integers(0, len(roots) - 1))]
        cut = draw(st.integers(1, len(root)))
        tail = draw(st.lists(st.integers(41, 60), max_size=4))
        ids = [*root[:cut], *tail]
        # Chain the ids: a block's identity is its whole prefix, as with real chained hashes.
        blocks = tuple(h(hash(tuple(ids[: i + 1])) % 2**64) for i in range(len(ids)))
        out.append(TraceRequest(float(len(out)), BLOCK_SIZE * len(blocks) + 3, blocks))
    return out


@settings(max_examples=150, deadline=None)
@given(traces(), st.integers(1, 30))
def test_belady_and_infinite_bound_every_online_policy(trace: list[TraceRequest], cap: int) -> None:
    best = simulate_belady(trace, cap).num_hit_tokens
    bound = simulate_infinite(trace).num_hit_tokens
    online = {
        "vllm": simulate_vllm(trace, cap).num_hit_tokens,
        "radix": simulate_radix(trace, cap).num_hit_tokens,
        "kvfleet": simulate_kvfleet(
            trace, cap, config=lambda c: CacheTuning(num_t0_blocks=c)
        ).num_hit_tokens,
        "lru": simulate_lru(trace, cap).num_hit_tokens,
    }
    for name, hits in online.items():
        assert 0 <= hits <= best, name
    assert best <= bound


@settings(max_examples=150, deadline=None)
@given(traces(), st.integers(1, 30))
def test_vllm_replayed_one_request_at_a_time_is_block_lru(
    trace: list[TraceRequest], cap: int
) -> None:
    # Freed tail first, touched head first: recency falls along every chain, so the free queue
    # evicts exactly what a block LRU touched tail first evicts.
    assert simulate_vllm(trace, cap).num_hit_tokens == simulate_lru(trace, cap).num_hit_tokens
