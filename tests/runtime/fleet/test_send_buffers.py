"""The T2 server's reused send buffers: a bounded pool, every byte of every run still exactly the
cache's (no stale bytes from a previous transfer), buffers returned when a run ends early."""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import numpy as np
import torch
from aiohttp import web

from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey
from kvfleet_runtime.fleet import (
    CacheBlockSource,
    EmbeddedHintIndex,
    ExportedRun,
    FetchedRun,
    PeerFetcher,
    peer_routes,
)
from kvfleet_runtime.fleet.t2_protocol import BufferPool
from tests.runtime.fleet.t2_support import (
    KEY_A,
    KEY_B,
    LAYOUT,
    SECRET,
    TOKENS,
    make_cache,
    start_app,
    store,
)


def test_buffer_pool_best_fit_and_bounded() -> None:
    pool = BufferPool(max_idle=2)
    a, b, c = pool.take(100), pool.take(300), pool.take(200)
    assert len(pool) == 0 and a.nbytes == 100
    for buf in (a, b, c):
        pool.give(buf)
    assert len(pool) == 2  # the smallest (a) was dropped
    assert pool.take(150) is c  # best fit, not the largest
    assert pool.take(250) is b
    assert pool.take(10) is not a and len(pool) == 0


def fetched(run: FetchedRun, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert run.num_blocks == num_blocks
    full = (LAYOUT.num_layers, LAYOUT.num_kv_heads, run.capacity_blocks * BLOCK_SIZE, -1)
    n = num_blocks * BLOCK_SIZE
    k = torch.frombuffer(run.k, dtype=torch.float16).view(full)[:, :, :n]
    v = torch.frombuffer(run.v, dtype=torch.float16).view(full)[:, :, :n]
    return k.clone(), v.clone()


async def test_send_buffers_are_reused_and_every_run_is_exact(
    session: aiohttp.ClientSession,
) -> None:
    cache = make_cache()
    ka, va = store(cache, KEY_A, TOKENS)
    other = [t + 7 for t in TOKENS]
    kb, vb = store(cache, KEY_B, other)
    pool = BufferPool(max_idle=2)
    app = web.Application()
    block_bytes = LAYOUT.bytes_per_block
    app.add_routes(
        peer_routes(CacheBlockSource(cache), SECRET, chunk_bytes=3 * block_bytes, buffers=pool)
    )
    url, runner = await start_app(app)
    try:
        fetcher = PeerFetcher(SECRET, EmbeddedHintIndex(), "me")
        cases: Sequence[tuple[CacheKey, list[int], int, torch.Tensor, torch.Tensor]] = [
            (KEY_A, TOKENS, 0, ka, va),
            (KEY_B, other, 0, kb, vb),
            (KEY_A, TOKENS, 3, ka, va),  # a shorter run into the same (larger) buffers
            (KEY_B, other, 5, kb, vb),
        ]
        seen: set[int] = set()
        for key, tokens, start, k, v in cases:
            run = await fetcher.fetch_from(url, key, tokens, start, 8)
            got_k, got_v = fetched(run, 8 - start)
            lo, hi = start * BLOCK_SIZE, 8 * BLOCK_SIZE
            assert torch.equal(got_k, k[:, :, lo:hi]) and torch.equal(got_v, v[:, :, lo:hi])
            assert 0 < len(pool) <= 2
            seen |= {id(b) for b in pool._idle}
        assert len(seen) <= 3  # the same buffers went round, not one per chunk per transfer
    finally:
        await runner.cleanup()


class FailingSource:
    """Serves the cache's run but reports a block gone at the `fail_at`-th chunk read."""

    def __init__(self, inner: CacheBlockSource, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.reads = 0

    async def export(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> ExportedRun | None:
        run = await self.inner.export(key, token_ids, start_block, max_blocks)
        assert run is not None
        read = run.read

        def failing(hashes: Sequence[bytes], k: memoryview, v: memoryview) -> bool:
            self.reads += 1
            return False if self.reads == self.fail_at else read(hashes, k, v)

        run.read = failing
        return run


async def test_run_ending_early_returns_its_buffers(session: aiohttp.ClientSession) -> None:
    cache = make_cache()
    k, v = store(cache, KEY_A, TOKENS)
    pool = BufferPool(max_idle=4)
    source = FailingSource(CacheBlockSource(cache), fail_at=3)
    app = web.Application()
    app.add_routes(
        peer_routes(source, SECRET, chunk_bytes=2 * LAYOUT.bytes_per_block, buffers=pool)
    )
    url, runner = await start_app(app)
    try:
        fetcher = PeerFetcher(SECRET, EmbeddedHintIndex(), "me")
        run = await fetcher.fetch_from(url, KEY_A, TOKENS, 0, 8)
        got_k, got_v = fetched(run, 4)  # chunks 0 and 1, then the block was "gone"
        assert torch.equal(got_k, k[:, :, : 4 * BLOCK_SIZE])
        assert torch.equal(got_v, v[:, :, : 4 * BLOCK_SIZE])
        assert len(pool) == 2 and all(isinstance(b, np.ndarray) for b in pool._idle)
    finally:
        await runner.cleanup()
