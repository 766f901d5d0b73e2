"""`PrefixCache.read_blocks(out=...)`: gathering into preallocated, reused buffers (the T2 server's
send buffers) gives exactly what a fresh export gives, across tiers, and leaves `out` untouched
when a block is missing or the buffers do not fit."""

from __future__ import annotations

import pytest
import torch

from kvfleet_runtime.cache import BLOCK_SIZE, BlockHash, CacheTuning, Hit, KVLayout, PrefixCache
from tests.runtime.cache.conftest import FakeClock, make_key

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32")


def kv(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, num_tokens, LAYOUT.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def held(
    cache: PrefixCache, tokens: list[int], seed: int = 0
) -> tuple[tuple[BlockHash, ...], tuple[torch.Tensor, torch.Tensor]]:
    key = make_key()
    k, v = kv(len(tokens), seed)
    for _ in range(2):
        cache.store(key, tokens, k, v)
    cache.drain_store_queue()
    hit = cache.lookup(key, tokens)
    assert isinstance(hit, Hit)
    cache.release(hit)
    return hit.blocks, (k, v)


def empty(num_blocks: int, fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, num_blocks * BLOCK_SIZE, LAYOUT.head_dim)
    return torch.full(shape, fill), torch.full(shape, fill)


def test_out_equals_fresh_export_and_is_returned(clock: FakeClock) -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=16), LAYOUT, clock=clock)
    blocks, (k, v) = held(cache, list(range(80)))
    fresh = cache.read_blocks(blocks)
    assert fresh is not None
    out = empty(5)
    got = cache.read_blocks(blocks, out=out)
    assert got is not None and got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


def test_reused_buffer_gets_each_run_exactly(clock: FakeClock) -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=32), LAYOUT, clock=clock)
    a_blocks, (ka, va) = held(cache, list(range(64)), seed=1)
    b_blocks, (kb, vb) = held(cache, list(range(1000, 1064)), seed=2)
    out = empty(4)
    for blocks, (k, v) in [(a_blocks, (ka, va)), (b_blocks, (kb, vb)), (a_blocks, (ka, va))]:
        assert cache.read_blocks(blocks, out=out) is not None
        assert torch.equal(out[0], k) and torch.equal(out[1], v)
    # A sub-run into a token-prefix view of a larger buffer (a pool's capacity buffer).
    big = empty(8)
    view = (big[0][:, :, : 2 * BLOCK_SIZE], big[1][:, :, : 2 * BLOCK_SIZE])
    assert cache.read_blocks(b_blocks[1:3], out=view) is not None
    assert torch.equal(view[0], kb[:, :, BLOCK_SIZE : 3 * BLOCK_SIZE])
    assert torch.equal(view[1], vb[:, :, BLOCK_SIZE : 3 * BLOCK_SIZE])
    assert torch.isnan(big[0][:, :, 2 * BLOCK_SIZE :]).all()  # nothing written past the run


def test_out_across_t0_and_t1(clock: FakeClock) -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=2, num_t1_blocks=8), LAYOUT, clock=clock)
    blocks, (k, v) = held(cache, list(range(96)))
    assert len(blocks) == 6
    out = empty(6)
    assert cache.read_blocks(blocks, out=out) is not None
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


def test_missing_block_leaves_out_untouched(clock: FakeClock) -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=16), LAYOUT, clock=clock)
    blocks, _ = held(cache, list(range(48)))
    out = empty(4, fill=7.0)
    assert cache.read_blocks([*blocks, b"x" * 16], out=out) is None  # type: ignore[list-item]
    assert (out[0] == 7.0).all() and (out[1] == 7.0).all()


def test_out_must_fit(clock: FakeClock) -> None:
    cache = PrefixCache(CacheTuning(num_t0_blocks=16), LAYOUT, clock=clock)
    blocks, _ = held(cache, list(range(48)))
    good = empty(3, fill=7.0)
    for bad in [
        empty(4),  # wrong length
        (good[0].double(), good[1].double()),  # wrong dtype
        (good[0], good[0]),  # K and V in the same storage
        (good[0], good[1][:1]),  # V of another shape
    ]:
        with pytest.raises(ValueError, match="read_blocks"):
            cache.read_blocks(blocks, out=bad)
    with pytest.raises(ValueError, match="read_blocks"):
        cache.read_blocks(blocks, out=good, device="meta")
    assert (good[0] == 7.0).all() and (good[1] == 7.0).all()
