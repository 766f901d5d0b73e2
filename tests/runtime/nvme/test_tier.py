"""T3 attached to a real PrefixCache on tiny pools and a real file: what T1 evicts and the policy
values goes to NVMe; a later miss is served from it (as the engine's prepare asks a tier below
the cache: `num_matched`, then `load_into` the engine's blocks) with exactly the stored KV
("on"), or read and discarded with the bandwidth recorded ("shadow"); "off" writes and serves
nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvfleet_runtime.cache import (
    CacheKey,
    CacheTuning,
    KVLayout,
    LoadTarget,
    LowerTier,
    Miss,
    PagedBlocks,
    PrefixCache,
    TierQuery,
    block_hashes,
)
from kvfleet_runtime.nvme import STORE_FILENAME, NvmeConfig, NvmeStore, NvmeTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=8, head_dim=4, dtype="float32")  # 8 KiB blocks
KEY = CacheKey("tenant-a", "tiny", "sha256:" + "a" * 64, "float32", "rope-1", "sdpa-v1")
A = list(range(128))  # 8 blocks
B = list(range(1000, 1128))


def kv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, num_tokens, LAYOUT.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


KA, VA = kv(128, 1)
KB, VB = kv(128, 2)


def store_twice(cache: PrefixCache, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    for _ in range(2):
        cache.store(KEY, tokens, k, v)
        cache.drain_store_queue()


@pytest.fixture
def cache() -> PrefixCache:
    # 4 + 4 blocks: storing B (8 blocks) after A pushes A's first half out of T1.
    return PrefixCache(CacheTuning(num_t0_blocks=4, num_t1_blocks=4), LAYOUT, clock=lambda: 0.0)


def make_tier(cache: PrefixCache, path: Path, **kw: object) -> NvmeTier:
    store = NvmeStore.open(NvmeConfig(path, 64 * LAYOUT.bytes_per_block, LAYOUT.bytes_per_block))
    assert store is not None
    tier = NvmeTier(cache, store, **kw)  # type: ignore[arg-type]
    tier.start()
    return tier


@pytest.fixture
def tier(cache: PrefixCache, tmp_path: Path) -> Iterator[NvmeTier]:
    t = make_tier(cache, tmp_path, mode="on")
    yield t
    t.close()


def load(tier: NvmeTier, tokens: Sequence[int], start_block: int = 0, *,
         key: CacheKey = KEY) -> tuple[int, torch.Tensor, torch.Tensor]:
    """What the engine's prepare does with T3 for a prompt whose first `start_block` blocks
    T0/T1 supply: ask, allocate, load into the engine's blocks. Returns the blocks landed and
    their K and V (canonical `[L, H, n * 16, D]`)."""
    query = TierQuery(1, key, tuple(tokens), tuple(block_hashes(key, tokens)), start_block)
    n = tier.num_matched(query)
    assert n is not None
    empty = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, 0, LAYOUT.head_dim)
    if not n:
        return 0, empty, empty
    kv = PagedBlocks.zeros(LAYOUT, 16, torch.device("cpu"))
    kv.take(3)  # the engine's own blocks elsewhere: the load lands where it is told
    ids = kv.take(n)
    assert ids is not None
    landed: list[int] = []
    called = threading.Event()

    def done(m: int) -> None:
        landed.append(m)
        called.set()

    tier.load_into(query, LoadTarget(kv, tuple(ids)), done)
    assert called.wait(30)
    got = landed[0]
    k = torch.cat([kv.k[:, i] for i in ids[:got]], dim=2) if got else empty
    v = torch.cat([kv.v[:, i] for i in ids[:got]], dim=2) if got else empty
    return got, k, v


def test_t3_is_a_tier_below_the_cache(tier: NvmeTier) -> None:
    assert isinstance(tier, LowerTier) and tier.name == "t3"


def evict_a(cache: PrefixCache, tier: NvmeTier) -> None:
    store_twice(cache, A, KA, VA)
    store_twice(cache, B, KB, VB)
    tier.flush()


def test_t1_evictions_the_policy_values_are_served_back_exactly(
    cache: PrefixCache, tier: NvmeTier
) -> None:
    evict_a(cache, tier)
    assert tier.stats.num_blocks_offered == 4 and tier.stats.num_blocks_refused == 0
    assert len(tier.store) == 4
    assert isinstance(cache.lookup(KEY, A), Miss)
    n, k, v = load(tier, A)
    assert n == 4
    assert torch.equal(k, KA[:, :, :64]) and torch.equal(v, VA[:, :, :64])
    assert tier.stats.num_blocks_served == 4
    assert sum(tier.store.bandwidth.counts[1]) == 1


def test_a_load_continues_what_the_tiers_above_supply(cache: PrefixCache, tier: NvmeTier) -> None:
    evict_a(cache, tier)
    # T0/T1 supply blocks 0-1: T3 is asked for what follows, and lands exactly blocks 2-3.
    n, k, v = load(tier, A, start_block=2)
    assert n == 2
    assert torch.equal(k, KA[:, :, 32:64]) and torch.equal(v, VA[:, :, 32:64])
    assert load(tier, A[:32])[0] == 2  # a shorter prompt: only its own blocks


def test_shadow_reads_back_and_discards(cache: PrefixCache, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    tier = make_tier(cache, tmp_path, mode="shadow", registry=registry)
    try:
        evict_a(cache, tier)
        assert len(tier.store) == 4  # written as "on" would
        assert load(tier, A)[0] == 0  # supplies nothing: read back on a worker, discarded
        tier.flush()
        assert tier.stats.num_blocks_shadow_read == 4 and tier.stats.num_blocks_served == 0
        assert isinstance(cache.lookup(KEY, A), Miss)  # nothing imported
        assert tier.store.bandwidth.per_read_gb_s(1) is not None
        report = tier.report()
        assert report["mode"] == "shadow"
        assert report["read_bandwidth"]["1"]["num_reads"] == 1  # type: ignore[index]
        text = generate_latest(registry).decode()
        assert 'kvfleet_nvme_read_bandwidth_gb_s_count{concurrency="1"} 1.0' in text
        assert 'kvfleet_nvme_mode{mode="shadow"} 1.0' in text
        assert "kvfleet_nvme_blocks_shadow_read_total 4.0" in text
    finally:
        tier.close()


def test_off_writes_nothing_and_turning_off_forgets(cache: PrefixCache, tier: NvmeTier) -> None:
    evict_a(cache, tier)
    tier.set_mode("off")
    assert len(tier.store) == 0
    assert load(tier, A)[0] == 0
    c, d = list(range(2000, 2128)), list(range(3000, 3128))
    store_twice(cache, c, KA, VA)  # evicts B's blocks: not offered while off
    tier.flush()
    assert len(tier.store) == 0 and tier.stats.num_blocks_offered == 4
    tier.set_mode("on")
    store_twice(cache, d, KB, VB)  # evicts C's blocks: offered again
    tier.flush()
    assert tier.stats.num_blocks_offered > 4 and len(tier.store) > 0


def test_one_shot_blocks_are_not_worth_an_nvme_write(cache: PrefixCache, tmp_path: Path) -> None:
    tier = make_tier(cache, tmp_path, mode="on", min_sightings=3)
    try:
        evict_a(cache, tier)  # A was seen twice: below 3
        assert tier.stats.num_blocks_offered == 4 and tier.stats.num_blocks_refused == 4
        assert len(tier.store) == 0
    finally:
        tier.close()


def test_a_full_write_queue_drops_instead_of_blocking(cache: PrefixCache, tmp_path: Path) -> None:
    tier = make_tier(cache, tmp_path, mode="on", max_pending_bytes=LAYOUT.bytes_per_block)
    tier.close()  # no writer: the queue only fills
    tier = NvmeTier(cache, tier.store, mode="on", max_pending_bytes=LAYOUT.bytes_per_block)
    evict_a(cache, tier)  # one stretch of 4 blocks > the 1-block budget
    assert tier.stats.num_blocks_dropped == 4


def test_a_corrupt_t3_block_is_recomputed_never_served(
    cache: PrefixCache, tier: NvmeTier, tmp_path: Path
) -> None:
    evict_a(cache, tier)
    with open(tmp_path / STORE_FILENAME, "r+b") as f:  # flip a byte in every slot
        for slot in range(4):
            f.seek(slot * LAYOUT.bytes_per_block + 10)
            f.write(b"\xff\xfe")
    query = TierQuery(1, KEY, tuple(A), tuple(block_hashes(KEY, A)), 0)
    assert tier.num_matched(query) == 4  # held, as far as the index knows: read, then refused
    assert load(tier, A)[0] == 0
    assert tier.store.stats.num_corrupt == 1


def test_the_store_must_match_the_cache_layout(cache: PrefixCache, tmp_path: Path) -> None:
    store = NvmeStore.open(NvmeConfig(tmp_path, 1 << 20, 4096))
    assert store is not None
    with pytest.raises(ValueError, match="block_bytes 4096 is not the cache's 8192"):
        NvmeTier(cache, store)
    with pytest.raises(ValueError, match=r"NVMe mode must be one of .* got 'fast'"):
        NvmeTier(cache, store, mode="fast")  # type: ignore[arg-type]



KEY_B = KEY._replace(weights_digest="sha256:" + "b" * 64)  # the same tenant, other weights
C = list(range(2000, 2128))


def test_invalidate_withdraws_one_version_from_t3(cache: PrefixCache, tier: NvmeTier) -> None:
    evict_a(cache, tier)  # A's first 4 blocks (version a) in T3
    for key, tokens, k, v in ((KEY_B, B, KB, VB), (KEY, C, KA, VA)):
        for _ in range(2):
            cache.store(key, tokens, k, v)
            cache.drain_store_queue()
    tier.flush()  # T1 evicted 4 more of version a, then B's first 4 blocks of version b
    assert len(tier.store) == 12
    assert tier.invalidate(KEY.weights_digest) == 8
    assert len(tier.store) == 4 and tier.store.stats.num_invalidated == 8
    assert load(tier, A)[0] == 0 and isinstance(cache.lookup(KEY, A), Miss)
    n, k, v = load(tier, B, key=KEY_B)  # version b is still served from T3, exactly
    assert n == 4
    assert torch.equal(k, KB[:, :, :64]) and torch.equal(v, VB[:, :, :64])


def test_a_write_queued_before_the_invalidate_never_lands(
    cache: PrefixCache, tmp_path: Path
) -> None:
    store = NvmeStore.open(NvmeConfig(tmp_path, 64 * LAYOUT.bytes_per_block,
                                      LAYOUT.bytes_per_block))
    assert store is not None
    tier = NvmeTier(cache, store, mode="on")  # not started: the offers stay queued
    store_twice(cache, A, KA, VA)
    store_twice(cache, B, KB, VB)
    assert tier.stats.num_blocks_offered == 4 and len(store) == 0
    assert tier.invalidate(KEY.weights_digest) == 0
    tier.start()
    tier.flush()
    assert len(store) == 0 and store.stats.num_stale_writes == 4
    assert load(tier, A)[0] == 0
    tier.close()
