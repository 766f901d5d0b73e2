"""The PrefixCache facade on tiny pools: hits equal what was stored, TP shards, tiers, admission,
invalidation, tenants, stats, metrics and the fleet-tier hooks."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvfleet_runtime.cache import (
    BlockEvent,
    CacheTuning,
    Hit,
    KVLayout,
    Miss,
    PrefixCache,
    StoreOutcome,
    Tier,
    block_hashes,
)
from kvfleet_runtime.cache import _cache as cache_module
from tests.runtime.cache.conftest import DIGEST_A, DIGEST_B, FakeClock, make_key

LAYOUT = KVLayout(num_layers=2, num_kv_heads=8, head_dim=4, dtype="float32")
ROOT = Path(__file__).resolve().parents[3]


def kv(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, num_tokens, LAYOUT.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def make_cache(clock: FakeClock, t0: int = 16, t1: int = 0, **kw: Any) -> PrefixCache:
    return PrefixCache(CacheTuning(num_t0_blocks=t0, num_t1_blocks=t1, **kw), LAYOUT, clock=clock)


def warm(
    cache: PrefixCache,
    key: object,
    tokens: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    times: int = 2,
) -> None:
    for _ in range(times):
        cache.store(key, tokens, k, v)  # type: ignore[arg-type]
    cache.drain_store_queue()


def test_partial_match_is_block_aligned_1507_to_1504(clock: FakeClock) -> None:
    cache = make_cache(clock, t0=128)
    key = make_key()
    prompt = list(range(1600))
    k, v = kv(1600)
    warm(cache, key, prompt, k, v)
    query = prompt[:1507] + [7] * 50
    hit = cache.lookup(key, query)
    assert isinstance(hit, Hit) and hit.matched_tokens == 1504 and len(hit.blocks) == 94
    mk, mv = cache.materialize(hit)
    assert torch.equal(mk, k[:, :, :1504]) and torch.equal(mv, v[:, :, :1504])
    cache.release(hit)


def test_only_prefixes_match(clock: FakeClock) -> None:
    cache = make_cache(clock)
    key = make_key()
    prompt = list(range(64))
    warm(cache, key, prompt, *kv(64))
    assert isinstance(cache.lookup(key, [5] * 16 + prompt), Miss)
    assert isinstance(cache.lookup(key, prompt[16:]), Miss)


def test_store_on_first_sighting_and_hit_on_second(clock: FakeClock) -> None:
    # The default admits on the first sighting: a conversation's next turn re-sends this prefix.
    cache = make_cache(clock)
    key = make_key()
    prompt = list(range(40))
    k, v = kv(40)
    assert cache.store(key, prompt, k, v) is StoreOutcome.QUEUED
    assert cache.drain_store_queue() == 2
    hit = cache.lookup(key, prompt)
    assert isinstance(hit, Hit) and hit.matched_tokens == 32
    cache.release(hit)
    assert cache.stats().totals.num_first_sighting_admissions == 2


def test_store_on_second_sighting_and_hit_on_third(clock: FakeClock) -> None:
    cache = make_cache(clock, admit_min_sightings=2)
    key = make_key()
    prompt = list(range(40))
    k, v = kv(40)
    assert cache.store(key, prompt, k, v) is StoreOutcome.REFUSED
    assert cache.drain_store_queue() == 0
    assert isinstance(cache.lookup(key, prompt), Miss)
    assert cache.store(key, prompt, k, v) is StoreOutcome.QUEUED
    assert cache.drain_store_queue() == 2  # 40 tokens: two full blocks, the tail is not stored
    assert cache.store(key, prompt, k, v) is StoreOutcome.RESIDENT
    hit = cache.lookup(key, prompt)
    assert isinstance(hit, Hit) and hit.matched_tokens == 32
    cache.release(hit)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_shards_reassemble_bitwise_to_the_tp1_tensor(clock: FakeClock, tp: int) -> None:
    cache = make_cache(clock, t0=4, t1=8)
    key = make_key()
    prompt = list(range(48))
    k, v = kv(48)
    warm(cache, key, prompt, k, v)
    hit = cache.lookup(key, prompt)
    assert isinstance(hit, Hit)
    full_k, full_v = cache.materialize(hit)
    out_k, out_v = torch.empty_like(full_k), torch.empty_like(full_v)
    for rank in range(tp):
        sk, sv = cache.materialize(hit, tp_degree=tp, tp_rank=rank)
        assert sk.shape == (2, 8 // tp, 48, 4)
        out_k[:, rank::tp], out_v[:, rank::tp] = sk, sv
    assert torch.equal(out_k, full_k) and torch.equal(out_v, full_v)
    assert torch.equal(full_k, k[:, :, :48])
    cache.release(hit)


@pytest.mark.parametrize(("tp", "rank"), [(3, 0), (0, 0), (2, 2), (2, -1), (16, 0)])
def test_bad_tp_is_rejected(clock: FakeClock, tp: int, rank: int) -> None:
    cache = make_cache(clock)
    key = make_key()
    warm(cache, key, list(range(16)), *kv(16))
    hit = cache.lookup(key, list(range(16)))
    assert isinstance(hit, Hit)
    with pytest.raises(ValueError, match="tp_"):
        cache.materialize(hit, tp_degree=tp, tp_rank=rank)


def test_t1_hit_is_promoted_and_materialized_with_one_copy_per_run(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(clock, t0=8, t1=8)
    key = make_key()
    prompt = list(range(64))
    k, v = kv(64)
    warm(cache, key, prompt, k, v)
    hit = cache.lookup(key, prompt)
    assert isinstance(hit, Hit) and hit.tier is Tier.T1
    copies: list[int] = []
    original = cache_module.read_blocks_into

    def spy(*args: object, **kw: object) -> int:
        n = original(*args, **kw)  # type: ignore[arg-type]
        copies.append(n)
        return n

    monkeypatch.setattr(cache_module, "read_blocks_into", spy)
    mk, _ = cache.materialize(hit)
    assert copies == [1]  # four blocks promoted into one run of T0, gathered with one copy
    assert torch.equal(mk, k)
    cache.release(hit)
    again = cache.lookup(key, prompt)
    assert isinstance(again, Hit) and again.tier is Tier.T0
    cache.release(again)
    stats = cache.stats()
    assert stats.tiers[1].num_promotions == 4


def test_materialize_after_eviction_pressure_still_returns_the_stored_data(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock, t0=4, t1=4)
    key = make_key()
    prompts = [[p * 1000 + i for i in range(32)] for p in range(6)]
    data = [kv(32, seed=p) for p in range(6)]
    for prompt, (k, v) in zip(prompts, data, strict=True):
        warm(cache, key, prompt, k, v, times=3)
    for prompt, (k, v) in zip(prompts, data, strict=True):
        hit = cache.lookup(key, prompt)
        if isinstance(hit, Hit):
            mk, mv = cache.materialize(hit)
            n = hit.matched_tokens
            assert torch.equal(mk, k[:, :, :n]) and torch.equal(mv, v[:, :, :n])
            cache.release(hit)
    cache._manager._index.check_invariants()


def test_tenants_never_share_and_platform_prefixes_do(clock: FakeClock) -> None:
    preamble = tuple(range(100, 132))  # two blocks
    cache = make_cache(clock, platform_prefixes=(preamble,))
    a, b = make_key("tenant-a"), make_key("tenant-b")
    private = list(range(48))
    warm(cache, a, private, *kv(48))
    assert isinstance(cache.lookup(b, private), Miss)
    shared = [*preamble, *range(500, 532)]
    warm(cache, a, shared, *kv(64))
    hit = cache.lookup(b, shared)
    assert isinstance(hit, Hit) and hit.matched_tokens == 32  # the platform preamble only
    cache.release(hit)
    with pytest.raises(ValueError, match="reserved"):
        cache.lookup(make_key("__platform__"), private)


@pytest.mark.parametrize("memo_entries", [0, 4, 65_536])
def test_block_hashes_are_the_chain_a_hit_is_filed_under(
    clock: FakeClock, memo_entries: int
) -> None:
    # The fleet tier publishes and fetches by `block_hashes`: it must be the chain `lookup` and
    # `store` use, platform scoping included, memo or not (a 4-step memo rotates constantly).
    preamble = tuple(range(100, 132))
    cache = make_cache(clock, platform_prefixes=(preamble,), hash_memo_entries=memo_entries)
    b = make_key("tenant-b")
    shared = [*preamble, *range(500, 532)]
    warm(cache, make_key("tenant-a"), shared, *kv(64))
    warm(cache, b, shared, *kv(64, seed=1))
    chain = cache.block_hashes(b, [*shared, 7])
    assert chain == block_hashes(b, shared, platform_blocks=2)
    hit = cache.lookup(b, shared)
    assert isinstance(hit, Hit) and hit.blocks == tuple(chain)
    cache.release(hit)
    assert (cache._manager._memo is None) == (memo_entries == 0)
    assert cache.stats().num_memo_hits == 0  # stores and block_hashes read; lookups remember
    assert cache.block_hashes(b, shared) == chain
    stats = cache.stats()
    assert (stats.num_memo_hits, stats.num_memo_misses > 0) == (
        (4, True) if memo_entries else (0, False)
    )


def test_a_memo_too_small_for_two_steps_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="hash_memo_entries"):
        CacheTuning(num_t0_blocks=4, hash_memo_entries=1)


def test_invalidate_makes_a_version_unreachable_and_reclaims_it(clock: FakeClock) -> None:
    cache = make_cache(clock, admit_min_sightings=2)
    old, new = make_key(digest=DIGEST_A), make_key(digest=DIGEST_B)
    prompt = list(range(48))
    warm(cache, old, prompt, *kv(48))
    warm(cache, new, prompt, *kv(48, seed=1))
    held = cache.lookup(old, prompt)
    assert isinstance(held, Hit)
    cache.store(old, list(range(900, 948)), *kv(48))
    cache.store(old, list(range(900, 948)), *kv(48))
    assert cache.stats().store_queue_len == 1
    assert cache.invalidate(DIGEST_A) == 3
    assert cache.stats().store_queue_len == 0  # its pending write is gone too
    assert cache.stats().totals.num_invalidated == 3
    assert isinstance(cache.lookup(old, prompt), Miss)
    hit_new = cache.lookup(new, prompt)
    assert isinstance(hit_new, Hit)
    cache.release(hit_new)
    assert cache.stats().tiers[0].num_blocks_used == 6  # held blocks are freed at release
    cache.materialize(held)  # still valid data for the request that holds it
    cache.release(held)
    assert cache.stats().tiers[0].num_blocks_used == 3
    with pytest.raises(ValueError, match="weights_digest"):
        cache.invalidate("latest")


def test_invalidate_racing_the_store_drain_never_leaves_the_version_indexed(
    clock: FakeClock,
) -> None:
    """The drain pops a write and is preempted; an invalidate of its version arrives right then.
    The write must not re-index blocks of the withdrawn version afterwards."""
    cache = make_cache(clock, admit_min_sightings=2)
    key = make_key(digest=DIGEST_A)
    prompt = list(range(32))
    cache.store(key, prompt, *kv(32))
    cache.store(key, prompt, *kv(32))
    assert cache.stats().store_queue_len == 1
    racer = threading.Thread(target=cache.invalidate, args=(DIGEST_A,))
    pop = cache._queue.pop

    def pop_then_race() -> Any:
        popped = pop()
        if popped is not None and not racer.is_alive() and racer.ident is None:
            racer.start()
            racer.join(timeout=0.2)  # runs now unless the drain holds the cache lock
        return popped

    cache._queue.pop = pop_then_race  # type: ignore[method-assign]
    cache.drain_store_queue()
    racer.join(timeout=10)
    assert not racer.is_alive()
    assert isinstance(cache.lookup(key, prompt), Miss)


def test_release_twice_is_an_error(clock: FakeClock) -> None:
    cache = make_cache(clock)
    key = make_key()
    warm(cache, key, list(range(16)), *kv(16))
    hit = cache.lookup(key, list(range(16)))
    assert isinstance(hit, Hit)
    cache.release(hit)
    with pytest.raises(ValueError, match="already released"):
        cache.release(hit)
    with pytest.raises(ValueError, match="already released"):
        cache.materialize(hit)


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((2, 8, 15, 4), torch.float32, "shape"),
        ((2, 4, 16, 4), torch.float32, "shape"),
        ((2, 8, 16, 4), torch.float16, "float32"),
    ],
)
def test_store_rejects_bad_tensors(
    clock: FakeClock, shape: tuple[int, ...], dtype: torch.dtype, match: str
) -> None:
    cache = make_cache(clock)
    t = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        cache.store(make_key(), list(range(16)), t, t)


def test_stats_per_tenant_and_prometheus_metrics(clock: FakeClock) -> None:
    registry = CollectorRegistry()
    config = CacheTuning(num_t0_blocks=8, admit_min_sightings=2)
    cache = PrefixCache(config, LAYOUT, clock=clock, registry=registry)
    PrefixCache(
        CacheTuning(num_t0_blocks=8), LAYOUT, clock=clock, registry=CollectorRegistry()
    )  # a second cache does not collide
    a, b = make_key("tenant-a"), make_key("tenant-b")
    prompt = list(range(40))
    warm(cache, a, prompt, *kv(40))
    hit = cache.lookup(a, prompt)
    assert isinstance(hit, Hit)
    cache.release(hit)
    assert isinstance(cache.lookup(b, prompt), Miss)
    sa = cache.stats("tenant-a").totals
    assert (sa.num_lookups, sa.num_hits, sa.num_lookup_tokens, sa.num_matched_tokens) == (
        1,
        1,
        40,
        32,
    )
    assert sa.token_hit_rate == pytest.approx(0.8) and sa.request_hit_rate == 1.0
    assert (sa.num_blocks_stored, sa.num_admissions_refused, sa.num_blocks) == (2, 2, 2)
    assert sa.num_bytes == 2 * LAYOUT.bytes_per_block
    assert cache.stats("tenant-b").totals.request_hit_rate == 0.0
    assert cache.stats().totals.num_lookups == 2
    get = registry.get_sample_value
    assert get("kvfleet_cache_lookups_total", {"tenant": "tenant-a"}) == 1
    assert get("kvfleet_cache_matched_tokens_total", {"tenant": "tenant-a"}) == 32
    assert get("kvfleet_cache_tier_used_blocks", {"tier": "t0"}) == 2
    assert get("kvfleet_cache_thrashing") == 0
    # Two stores and tenant-a's lookup hash 2 steps each, tenant-b's lookup 1: none remembered
    # before tenant-a's lookup, which stores and tenant-b's chain never read again.
    assert get("kvfleet_cache_hash_memo_misses_total") == 7
    assert get("kvfleet_cache_hash_memo_hits_total") == 0


def test_listener_hears_stores_and_removals(clock: FakeClock) -> None:
    cache = make_cache(clock, t0=2)
    events: list[BlockEvent] = []
    cache.add_listener(events.append)
    key = make_key()
    first, second = list(range(32)), list(range(100, 132))
    warm(cache, key, first, *kv(32))
    warm(cache, key, second, *kv(32), times=3)  # more frequent: wins the duel for both slots
    kinds = [(e.kind, len(e.block_hashes)) for e in events]
    assert kinds == [("stored", 2), ("removed", 2), ("stored", 2)]
    cache.invalidate(DIGEST_A)
    assert events[-1].kind == "removed" and len(events[-1].block_hashes) == 2


def test_read_blocks_and_import_blocks_round_trip_between_caches(clock: FakeClock) -> None:
    src, dst = make_cache(clock), make_cache(clock, t0=4, t1=4)
    key = make_key()
    prompt = list(range(50))
    k, v = kv(50)
    warm(src, key, prompt, k, v)
    hit = src.lookup(key, prompt)
    assert isinstance(hit, Hit)
    exported = src.read_blocks(hit.blocks)
    src.release(hit)
    assert exported is not None
    assert src.read_blocks([*hit.blocks, b"x" * 16]) is None  # type: ignore[list-item]
    assert dst._import_blocks(key, prompt[:48], *exported) == 3
    got = dst.lookup(key, prompt)
    assert isinstance(got, Hit) and got.matched_tokens == 48
    mk, mv = dst.materialize(got)
    assert torch.equal(mk, k[:, :, :48]) and torch.equal(mv, v[:, :, :48])
    dst.release(got)


def test_pure_modules_do_not_import_torch() -> None:
    modules = ["kvfleet_runtime.cache", "kvfleet_lab.cache.sim"] + [
        f"kvfleet_runtime.cache.{m}"
        for m in (
            "_keys",
            "_block_index",
            "_tier_slots",
            "_index_audit",
            "_tier_drains",
            "_sketch",
            "_ghosts",
            "_admission",
            "_store_queue",
            "_stats",
            "_manager",
            "_metrics",
            "_allocator",
            "_config",
        )
    ]
    code = f"import sys, {', '.join(modules)}; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "a pure module imported torch"
