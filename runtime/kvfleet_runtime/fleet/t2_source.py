"""T2, the serving side inside a replica: `CacheBlockSource` hands the T2 endpoint runs of a
`PrefixCache` (torch tensors), gathered in the order the fetcher asks for, and pins runs where
they lie for T2 over NIXL (`lease`: the lease routes answer their slots as descriptors).

    source = CacheBlockSource(cache, held=cache.num_held)
    app.add_routes(peer_routes(source, secret))
    app.add_routes(lease_routes(source, secret, serving, leases))

The fetching side is `fleet.peer_tier.PeerTier`, a tier below the cache that the engine's
prepare asks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvfleet_runtime.cache import BlockHash, CacheKey, Hit
from kvfleet_runtime.fleet.t2_protocol import WireOrder, chunk_axes
from kvfleet_runtime.fleet.t2_serve import ExportedRun, LeasedRun

if TYPE_CHECKING:
    from kvfleet_runtime.cache import PrefixCache

__all__ = ["CacheBlockSource", "pool_indexes"]

log = logging.getLogger(__name__)


class CacheBlockSource:
    """Serves held runs of a `PrefixCache` to the T2 endpoint, off the event loop.

    The chain is recomputed here from the request's key and tokens (never taken from the peer).
    With `held` (how many leading hashes of a chain this replica holds: `PrefixCache.num_held`,
    read from the index with no refs and no stats) the run is found without a `lookup`, so
    serving peers does not count in this replica's hit-rate stats; `read_blocks` is
    all-or-nothing under the cache lock, so a block evicted in between turns the answer into a
    404, never into wrong data. Without `held`, a
    `lookup` (which holds refs while reading) finds the run."""

    def __init__(
        self, cache: PrefixCache, *, held: Callable[[Sequence[BlockHash]], int] | None = None
    ) -> None:
        self.cache = cache
        self.held = held

    async def export(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> ExportedRun | None:
        return await asyncio.to_thread(self._export, key, token_ids, start_block, max_blocks)

    def _export(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> ExportedRun | None:
        release: Callable[[], None] = _nothing
        if self.held is not None:
            chain = self.cache.block_hashes(key, token_ids)[start_block : start_block + max_blocks]
            run = tuple(chain[: self.held(chain)])
        else:
            hit = self.cache.lookup(key, token_ids)
            if not isinstance(hit, Hit):
                return None
            run = hit.blocks[start_block : start_block + max_blocks]
            cache = self.cache

            def release() -> None:
                cache.release(hit)

        if not run:
            release()
            return None
        layout = self.cache.layout
        return ExportedRun(
            start_block,
            tuple(run),
            layout.dtype,
            (layout.num_layers, layout.num_kv_heads, layout.head_dim),
            layout.bytes_per_block,
            self._read,
            release,
        )

    async def lease(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> LeasedRun | None:
        # Off the loop, as `export`: pinning takes the cache's lock, which the engine and a
        # gather for an HTTP peer hold for milliseconds at a time.
        return await asyncio.to_thread(self._lease, key, token_ids, start_block, max_blocks)

    def _lease(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> LeasedRun | None:
        # The chain from (key, tokens), computed here: the key's tenant is in every hash, so a
        # tenant's credential pins (and describes) only that tenant's (or platform) blocks.
        cache = self.cache
        pinned = cache.pin(cache.block_hashes(key, token_ids), start_block, max_blocks)
        if pinned is None:
            return None
        index = pool_indexes(cache)
        layout = cache.layout
        return LeasedRun(
            start_block,
            tuple(pinned.block_hashes),
            layout.dtype,
            (layout.num_layers, layout.num_kv_heads, layout.head_dim),
            layout.bytes_per_block,
            tuple((index[tier], slot) for tier, slot in pinned.slots),
            lambda: cache.unpin(pinned),
        )

    def _read(self, hashes: Sequence[bytes], order: WireOrder, out: memoryview) -> bool:
        # Gather straight into the server's reused send buffer, in the order the fetcher lands
        # (no fresh tensors per export, no second copy): the cache's engine layout is no wire
        # order, so this one copy is made whichever order is asked.
        layout = self.cache.layout
        shape, perm = chunk_axes(order, len(hashes),
                                 (layout.num_layers, layout.num_kv_heads, layout.head_dim))
        kv = torch.frombuffer(out, dtype=torch.uint8).view(self.cache.dtype).view(shape)
        kv = kv.permute(perm)  # [K|V, layers, heads, blocks, 16, head_dim]
        got = self.cache.read_blocks([BlockHash(h) for h in hashes], device="cpu",
                                     out=(kv[0], kv[1]))
        return got is not None


def pool_indexes(cache: PrefixCache) -> dict[int, int]:
    """Tier -> index of its pool among the cache's pools that exist (`PrefixCache.pools()`
    without the Nones): the order `NixlAgent.start` registers them in and the lease routes
    number them in."""
    present = [tier for tier, pool in enumerate(cache.pools()) if pool is not None]
    return {tier: i for i, tier in enumerate(present)}


def _nothing() -> None:
    return None
