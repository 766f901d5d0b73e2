"""What the T2 tests share (test_t2_fetch_and_serve.py, test_probe.py, test_wire.py,
test_send_buffers.py): a fleet key and layout, a cache holding a prefilled prompt, an app on a
free loopback port, and `land`, which drives T2 as the engine's prepare does."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch
from aiohttp import web

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    CacheKey,
    CacheTuning,
    KVLayout,
    LoadTarget,
    PagedBlocks,
    PrefixCache,
    TierQuery,
)
from kvfleet_runtime.fleet import PeerFetcher, PeerTier
from tests.support import free_port

SECRET = b"fleet-secret-for-tests"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
DIGEST = "sha256:" + "ab" * 32
KEY_A = CacheKey("tenant-a", "tiny", DIGEST, "float16", "rope0", "sdpa")
KEY_B = KEY_A._replace(tenant_id="tenant-b")
TOKENS = list(range(1000, 1000 + 8 * BLOCK_SIZE + 5))  # 8 full blocks and a partial tail


def make_cache() -> PrefixCache:
    return PrefixCache(
        CacheTuning(num_t0_blocks=64, admit_min_sightings=1, hot_min_sightings=2),
        LAYOUT,
        clock=time.monotonic,
    )


def prefill_kv(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for recompute: causal like prefill (position t depends on tokens[: t + 1])."""
    g = torch.Generator().manual_seed(0)
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, 4096, LAYOUT.head_dim)
    ids = torch.tensor(tokens, dtype=torch.float32).cumsum(0).view(1, 1, -1, 1) * 1e-3
    n = len(tokens)
    return (
        (torch.randn(shape, generator=g)[:, :, :n] + ids).half(),
        (torch.randn(shape, generator=g)[:, :, :n] - ids).half(),
    )


def store(cache: PrefixCache, key: CacheKey, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    k, v = prefill_kv(tokens)
    cache.store(key, tokens, k, v)
    cache.drain_store_queue()
    return k, v


async def start_app(app: web.Application) -> tuple[str, web.AppRunner]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


POOL_BLOCKS = 24
SCATTERED = (9, 10, 11, 3, 4, 20, 0, 6)
"""Engine blocks a run lands in: runs of consecutive ids and single ones."""


@dataclass
class Landed:
    """What `land` left in the engine-shaped pool: the blocks landed, and their K and V in
    canonical `[L, H, n * 16, D]`."""

    num_blocks: int
    k: torch.Tensor
    v: torch.Tensor


async def land(fetcher: PeerFetcher, key: CacheKey, tokens: list[int], start_block: int = 0,
               *, block_ids: tuple[int, ...] = SCATTERED, request_id: int = 1) -> Landed:
    """What the engine's prepare does with T2 for `tokens`, whose first `start_block` blocks
    the tiers above supply: ask until it knows, allocate, land, wait for `done`."""
    tier = PeerTier(fetcher, LAYOUT, asyncio.get_running_loop())
    chain = tuple(make_cache().block_hashes(key, tokens[: len(tokens) // BLOCK_SIZE * BLOCK_SIZE]))
    query = TierQuery(request_id, key, tuple(tokens), chain, start_block)
    while (n := tier.num_matched(query)) is None:
        await asyncio.sleep(0.001)
    empty = torch.empty(LAYOUT.num_layers, LAYOUT.num_kv_heads, 0, LAYOUT.head_dim)
    if not n:
        return Landed(0, empty, empty)
    kv = PagedBlocks.zeros(LAYOUT, POOL_BLOCKS, torch.device("cpu"))
    ids = block_ids[:n]
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    tier.load_into(query, LoadTarget(kv, ids), done.set_result)
    got = await done
    if not got:
        return Landed(0, empty, empty)
    return Landed(got, torch.cat([kv.k[:, i] for i in ids[:got]], dim=2),
                  torch.cat([kv.v[:, i] for i in ids[:got]], dim=2))
