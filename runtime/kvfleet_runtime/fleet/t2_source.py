"""T2, the serving side inside a replica: `CacheBlockSource` hands the T2 endpoint runs of a
`PrefixCache` (torch tensors), gathered in the order the fetcher asks for.

    app.add_routes(peer_routes(CacheBlockSource(cache, held=cache.num_held), secret))

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
from kvfleet_runtime.fleet.t2_serve import ExportedRun

if TYPE_CHECKING:
    from kvfleet_runtime.cache import PrefixCache

__all__ = ["CacheBlockSource"]

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


def _nothing() -> None:
    return None
