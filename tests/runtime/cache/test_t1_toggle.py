"""T1 off, live, on a real PrefixCache: its blocks become unreachable at once and their slots are
freed, except under an in-flight hit, which keeps reading the right data until its release;
stores and demotions stop using T1; T1 on again takes blocks again."""

from __future__ import annotations

import torch

from kvfleet_runtime.cache import BlockEvent, CacheKey, CacheTuning, Hit, KVLayout, PrefixCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")
KEY = CacheKey("tenant-a", "tiny", "sha256:" + "a" * 64, "float32", "rope-1", "sdpa-v1")


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, n, 4)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def used(cache: PrefixCache) -> tuple[int, int]:
    t0, t1 = cache.stats().tiers
    return t0.num_blocks_used, t1.num_blocks_used


def test_t1_off_drains_t1_and_in_flight_hits_keep_their_refs() -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=2, num_t1_blocks=8), LAYOUT, clock=lambda: 0.0)
    events: list[BlockEvent] = []
    cache.add_listener(events.append)
    a, b = list(range(64)), list(range(100, 164))  # 4 blocks each
    ka, va = kv(64, 1)
    kb, vb = kv(64, 2)
    cache.store(KEY, a, ka, va)
    cache.store(KEY, b, kb, vb)
    cache.drain_store_queue()
    assert used(cache) == (0, 8)  # reused placement: T1
    held = cache.lookup(KEY, a)  # an in-flight hit on A
    assert isinstance(held, Hit) and held.matched_tokens == 64
    events.clear()
    assert cache.set_t1_enabled(False) == 8
    # Unreachable at once, withdrawn from the hint index...
    assert cache.lookup(KEY, b).__class__.__name__ == "Miss"
    assert cache.lookup(KEY, a).__class__.__name__ == "Miss"
    assert sorted(len(e.block_hashes) for e in events if e.kind == "removed") == [8]
    # ...B's slots freed now, A's held by the in-flight hit, which still reads A exactly.
    assert used(cache) == (0, 4)
    k, v = cache.materialize(held)
    assert torch.equal(k, ka) and torch.equal(v, va)
    cache.release(held)
    assert used(cache) == (0, 0)
    # While off, stores go to T0 only (2 blocks) and nothing is demoted into T1.
    cache.store(KEY, a, ka, va)
    cache.drain_store_queue()
    assert used(cache) == (2, 0)
    hit = cache.lookup(KEY, a)
    assert isinstance(hit, Hit) and hit.matched_tokens == 32
    k, _ = cache.materialize(hit)
    assert torch.equal(k, ka[:, :, :32])
    cache.release(hit)
    cache._manager._index.check_invariants()
    # On again: T1 takes blocks again.
    assert cache.set_t1_enabled(True) == 0
    cache.store(KEY, b, kb, vb)
    cache.drain_store_queue()
    assert used(cache)[1] > 0
    cache._manager._index.check_invariants()
