"""The fleet tier inside a replica: glue between `PrefixCache` (torch tensors) and the torch-free
hint index, publisher and T2 transfer.

    tier = PeerTier(cache, fetcher, publisher)       # publisher may be None
    cache.add_listener(tier.on_block_event)          # stored -> publish, removed -> withdraw
    app.add_routes(peer_routes(CacheBlockSource(cache), secret))
    ...
    hit = cache.lookup(key, token_ids)
    local_blocks = hit.matched_tokens // 16 if isinstance(hit, Hit) else 0
    if await tier.fill(key, token_ids, local_blocks):   # fetched more blocks from a peer
        cache.release(hit) if a hit; hit = cache.lookup(key, token_ids)

`fill` never raises and returns 0 on any failure: the request then prefills what is missing,
exactly as without a fleet tier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvfleet_runtime.cache import BLOCK_SIZE, BlockEvent, BlockHash, CacheKey, Hit
from kvfleet_runtime.fleet.publisher import HintPublisher
from kvfleet_runtime.fleet.t2_fetch import FetchedRun, FetchOutcome, PeerFetcher
from kvfleet_runtime.fleet.t2_protocol import WireOrder, chunk_axes
from kvfleet_runtime.fleet.t2_serve import ExportedRun

if TYPE_CHECKING:
    from kvfleet_runtime.cache import PrefixCache

__all__ = ["CacheBlockSource", "PeerTier"]

log = logging.getLogger(__name__)


class CacheBlockSource:
    """Serves held runs of a `PrefixCache` to the T2 endpoint, off the event loop.

    The chain is recomputed here from the request's key and tokens (never taken from the peer).
    With `held` (how many leading hashes of a chain this replica holds, from its own cache
    events) the run is found without a `lookup`, so serving peers does not count in this
    replica's hit-rate stats; `read_blocks` is all-or-nothing under the cache lock, so a block
    evicted in between turns the answer into a 404, never into wrong data. Without `held`, a
    `lookup` (which holds refs while reading) finds the run."""

    def __init__(
        self, cache: PrefixCache, *, held: Callable[[Sequence[bytes]], int] | None = None
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


class PeerTier:
    """Local-miss path to peers (fetch + import) and hint publishing from cache events."""

    def __init__(
        self,
        cache: PrefixCache,
        fetcher: PeerFetcher,
        publisher: HintPublisher | None = None,
        *,
        max_fetch_blocks: int = 4096,
    ) -> None:
        self.cache = cache
        self.fetcher = fetcher
        self.publisher = publisher
        self.max_fetch_blocks = max_fetch_blocks
        self.enabled = True
        """Follows the fleet config's `tiers.t2_peer` toggle; off -> `fill` returns 0 at once."""

    def on_block_event(self, event: BlockEvent) -> None:
        if self.publisher is None:
            return
        if event.kind == "stored":
            self.publisher.offer_stored(event.block_hashes, tenant=event.key.tenant_id)
        else:
            self.publisher.offer_removed(event.block_hashes, tenant=event.key.tenant_id)

    def on_local_hit(self, hit: Hit) -> None:
        """Keep the hints of blocks in use alive (re-published at most every refresh period)."""
        if self.publisher is not None:
            self.publisher.offer_stored(hit.blocks, refresh=True, tenant=hit.key.tenant_id)

    async def fill(self, key: CacheKey, token_ids: Sequence[int], local_blocks: int) -> int:
        """Fetch the blocks after the first `local_blocks` from the best peer and import them;
        returns the number of blocks now held beyond `local_blocks` (0 on any failure)."""
        if not self.enabled:
            return 0
        try:
            chain = self.cache.block_hashes(key, token_ids)
            chain = chain[: local_blocks + self.max_fetch_blocks]
            if len(chain) <= local_blocks:
                return 0
            layout = self.cache.layout
            run = await self.fetcher.fetch(
                key,
                token_ids,
                chain,
                start_block=local_blocks,
                expected_dtype=layout.dtype,
                expected_layout=(layout.num_layers, layout.num_kv_heads, layout.head_dim),
            )
            if run is None:
                return 0
            return await asyncio.to_thread(self._import, key, token_ids, chain, run)
        except Exception:
            log.exception("T2 fill failed; recomputing")
            self.fetcher.stats.count(FetchOutcome.ERROR)
            return 0

    def _import(
        self, key: CacheKey, token_ids: Sequence[int], chain: list[BlockHash], run: FetchedRun
    ) -> int:
        dtype = self.cache.dtype
        layers, heads, head_dim = run.layout
        full = (layers, heads, run.capacity_blocks * BLOCK_SIZE, head_dim)
        n_tokens = run.num_blocks * BLOCK_SIZE
        k = torch.frombuffer(run.k, dtype=dtype).view(full)[:, :, :n_tokens]
        v = torch.frombuffer(run.v, dtype=dtype).view(full)[:, :, :n_tokens]
        start = run.start_block
        if start:
            # import_blocks takes the whole prefix: the local part comes from this cache.
            local = self.cache.read_blocks(chain[:start], device="cpu")
            if local is None:
                self.fetcher.stats.count(FetchOutcome.LOCAL_EVICTED)
                return 0
            k = torch.cat([local[0], k], dim=2)
            v = torch.cat([local[1], v], dim=2)
        end_block = start + run.num_blocks
        self.cache.import_blocks(key, token_ids[: end_block * BLOCK_SIZE], k, v)
        del k, v  # import_blocks copied them: the receive buffers can be reused
        self.fetcher.recycle(run)
        return run.num_blocks
