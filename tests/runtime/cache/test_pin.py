"""`PrefixCache.pin`: blocks held where they lie for a one-sided reader (T2 over NIXL). A pinned
block is never evicted, moved or overwritten before `unpin`, whatever the pressure; its slot holds
its bytes; pinning counts no lookup."""

from __future__ import annotations

import torch

from kvfleet_runtime.cache import BLOCK_SIZE, CacheTuning, PrefixCache
from tests.runtime.cache.conftest import FakeClock, make_key
from tests.runtime.cache.test_read_blocks import LAYOUT, held, kv


def slot_bytes(cache: PrefixCache, tier: int, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    pool = cache.pools()[tier]
    assert pool is not None
    return pool.k[:, block_id].clone(), pool.v[:, block_id].clone()


def test_pinned_slots_hold_the_blocks_bytes(clock: FakeClock) -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=16), LAYOUT, clock=clock)
    tokens = list(range(5 * BLOCK_SIZE))
    blocks, (k, v) = held(cache, tokens)
    run = cache.pin(list(blocks), start_block=1, max_blocks=3)
    assert run is not None
    assert run.block_hashes == blocks[1:4]
    lookups = cache.stats().totals.num_lookups
    for i, (tier, block_id) in enumerate(run.slots, start=1):
        assert tier == 0
        got_k, got_v = slot_bytes(cache, tier, block_id)
        tokens_i = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
        assert torch.equal(got_k, k[:, :, tokens_i]) and torch.equal(got_v, v[:, :, tokens_i])
    assert cache.stats().totals.num_lookups == lookups
    cache.unpin(run)
    cache.unpin(run)  # once only: a second call does nothing


def test_a_chain_not_held_pins_nothing(clock: FakeClock) -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=16), LAYOUT, clock=clock)
    blocks, _ = held(cache, list(range(2 * BLOCK_SIZE)))
    other = cache.block_hashes(make_key("tenant-b"), list(range(2 * BLOCK_SIZE)))
    assert cache.pin(other) is None
    assert cache.pin(list(blocks), start_block=2) is None


def test_pinned_blocks_survive_eviction_until_unpinned(clock: FakeClock) -> None:
    # T0 only (no T1), 8 blocks: every new prompt evicts old blocks unless they are pinned.
    cache = PrefixCache(CacheTuning(num_t0_blocks=8), LAYOUT, clock=clock)
    blocks, _ = held(cache, list(range(4 * BLOCK_SIZE)), seed=1)
    run = cache.pin(list(blocks))
    assert run is not None
    before = [slot_bytes(cache, tier, b) for tier, b in run.slots]
    for seed in range(2, 8):  # far more than the 4 free blocks
        held_tokens = list(range(seed * 1000, seed * 1000 + 4 * BLOCK_SIZE))
        key = make_key()
        nk, nv = kv(len(held_tokens), seed)
        for _ in range(2):
            cache.store(key, held_tokens, nk, nv)
        cache.drain_store_queue()
    assert cache.num_held(list(blocks)) == 4
    after = [slot_bytes(cache, tier, b) for tier, b in run.slots]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(before, after, strict=True))
    cache.unpin(run)
    for seed in range(8, 12):
        held_tokens = list(range(seed * 1000, seed * 1000 + 4 * BLOCK_SIZE))
        nk, nv = kv(len(held_tokens), seed)
        for _ in range(2):
            cache.store(make_key(), held_tokens, nk, nv)
        cache.drain_store_queue()
    assert cache.num_held(list(blocks)) < 4  # unpinned: evictable again
