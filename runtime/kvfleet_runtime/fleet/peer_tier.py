"""T2 as a tier below the cache (`kvfleet_runtime.cache.LowerTier`): the engine's prepare asks
it, after T0, T1 and T3, for the blocks of the prompt's chain they lack; it lands a peer's run
straight in the blocks the engine allocated.

    tier = PeerTier(fetcher, layout, loop)          # the fleet tier's, while it runs
    replica.peers = tier; replica.wire_tiers()      # the engine asks it after T3

- `num_matched`: the hint index's answer (`PeerFetcher.find`: which peer holds the longest run
  of the chain after `query.start_block`). The lookup runs on the event loop; until it answers,
  `num_matched` says None (the engine asks again at its next step) and never waits.
- `load_into`: the transfer (`PeerFetcher.receive_into`), on the event loop, in the engine's own
  order (`WireOrder.CLBHN`: per K|V and layer, a run of consecutive engine blocks is one
  stretch), each chunk received in place in the engine's blocks and checksummed there. A pool
  off the host (a GPU's) is landed through a host staging buffer, one copy per run of blocks.
  `done(n)`: the leading blocks verified; 0 on any failure (the engine recomputes).
- `forget`: a lookup still in flight is cancelled; a transfer runs to its end or its deadline
  (`PeerFetcher.timeout_s`), the engine keeping the blocks until `done`.

Off (`enabled` False: the fleet config's `tiers.t2_peer`), it matches nothing. With a NIXL
agent (`fleet.t2_nixl`, its pools the cache's, the engine's blocks among them) the transfer is a
lease and a one-sided READ straight into the engine's blocks (`PeerFetcher.receive_leased`); a
peer without NIXL is fetched from over HTTP, and any failure on either path lands nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    KVLayout,
    LoadTarget,
    PagedBlocks,
    TierQuery,
    paired_runs,
)
from kvfleet_runtime.fleet.t2_fetch import Landing, PeerFetcher, PeerRun
from kvfleet_runtime.fleet.t2_protocol import WireOrder

if TYPE_CHECKING:
    from kvfleet_runtime.fleet.t2_nixl import NixlAgent

__all__ = ["PeerTier", "engine_landing"]

log = logging.getLogger(__name__)


class PeerTier:
    """T2, the fleet's peers, as a tier below the cache (module docstring)."""

    name = "t2"

    def __init__(
        self,
        fetcher: PeerFetcher,
        layout: KVLayout,
        loop: asyncio.AbstractEventLoop,
        *,
        max_fetch_blocks: int = 4096,
        nixl: NixlAgent | None = None,
    ) -> None:
        """`loop`: the event loop the lookups and transfers run on (the replica's); `nixl`:
        this replica's NIXL agent, whose registered pools the engine's blocks are among."""
        self.fetcher = fetcher
        self.nixl = nixl
        self.layout = layout
        self.loop = loop
        self.max_fetch_blocks = max_fetch_blocks
        self.enabled = True
        """Follows the fleet config's `tiers.t2_peer`: off, nothing is matched."""
        self._lock = threading.Lock()
        self._finding: dict[int, tuple[int, concurrent.futures.Future[PeerRun | None]]] = {}
        self._found: dict[int, PeerRun] = {}

    def num_matched(self, query: TierQuery) -> int | None:
        """Blocks after `query.start_block` the best peer holds (0: none, off, or fewer than
        the fetcher's `min_blocks`); None while the hint lookup is in flight."""
        if not self.enabled:
            return 0
        start = query.start_block
        wanted = query.chain[start : start + self.max_fetch_blocks]
        if len(wanted) < self.fetcher.min_blocks:
            return 0
        with self._lock:
            asked = self._finding.get(query.request_id)
        if asked is None or asked[0] != start:
            if asked is not None:
                asked[1].cancel()
            try:
                future = asyncio.run_coroutine_threadsafe(
                    self.fetcher.find(query.key, wanted), self.loop)
            except RuntimeError:  # the loop is closed: shutting down
                return 0
            with self._lock:
                self._finding[query.request_id] = (start, future)
            return None
        future = asked[1]
        if not future.done():
            return None
        with self._lock:
            self._finding.pop(query.request_id, None)
        try:
            peer = future.result()
        except Exception:  # the fleet tier never fails a request: the engine prefills instead
            log.exception("T2 hint lookup failed; recomputing")
            peer = None
        if peer is None:
            return 0
        n = min(peer.num_blocks, len(wanted))
        with self._lock:
            self._found[query.request_id] = dataclasses.replace(peer, num_blocks=n)
        return n

    def load_into(self, query: TierQuery, target: LoadTarget,
                  done: Callable[[int], None]) -> None:
        """Start the transfer from the peer `num_matched` found, on the event loop."""
        with self._lock:
            peer = self._found.pop(query.request_id, None)
        if peer is None or not 0 < len(target.block_ids) <= peer.num_blocks:
            done(0)
            return
        try:
            asyncio.run_coroutine_threadsafe(self._load(query, peer, target, done), self.loop)
        except RuntimeError:  # the loop is closed: nothing lands
            done(0)

    def forget(self, query: TierQuery) -> None:
        """Cancel a lookup in flight and drop a peer found for a load that will not start."""
        with self._lock:
            asked = self._finding.pop(query.request_id, None)
            self._found.pop(query.request_id, None)
        if asked is not None:
            asked[1].cancel()

    async def _load(self, query: TierQuery, peer: PeerRun, target: LoadTarget,
                    done: Callable[[int], None]) -> None:
        landed = 0
        try:
            n = len(target.block_ids)
            start = query.start_block
            layout = self.layout
            shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
            pool = self._registered_pool(target.kv)
            if pool is not None and self.nixl is not None and self.fetcher.serves_nixl(peer.url):
                over_nixl = await self.fetcher.receive_leased(
                    peer, query.key, query.token_ids, query.chain[start : start + n],
                    start_block=start, dtype=layout.dtype, layout=shape, agent=self.nixl,
                    local_slots=[(pool, b) for b in target.block_ids])
                if over_nixl is not None:  # None: the peer has no NIXL, fetch over HTTP
                    landed = over_nixl
                    return
            landing, finish = engine_landing(target.kv, target.block_ids)
            landed = await self.fetcher.receive_into(
                peer, query.key, query.token_ids, query.chain[start : start + n],
                start_block=start, dtype=layout.dtype,
                layout=(layout.num_layers, layout.num_kv_heads, layout.head_dim),
                landing=landing, order=WireOrder.CLBHN)
            if landed and finish is not None:
                await asyncio.to_thread(finish, landed)
        except Exception:  # the fleet tier never fails a request: the engine prefills instead
            landed = 0
            log.exception("T2 load failed; recomputing")
        finally:  # also when cancelled (shutdown): nothing lands after this
            done(landed)

    def _registered_pool(self, kv: PagedBlocks) -> int | None:
        """The index of the engine's pool among the NIXL agent's, or None (no agent, or the
        pool is not one it registered)."""
        if self.nixl is None:
            return None
        k, v = (kv.kv[0], kv.kv[1]) if kv.kv is not None else (kv.k, kv.v)
        return next((i for i, g in enumerate(self.nixl.geometries)
                     if g.k_addr == k.data_ptr() and g.v_addr == v.data_ptr()
                     and g.num_blocks == k.shape[1]), None)


def engine_landing(
    kv: PagedBlocks, block_ids: Sequence[int]
) -> tuple[Landing, Callable[[int], None] | None]:
    """Where a CLBHN run for the engine's blocks `block_ids` lands: (the fetcher's `Landing`,
    then what to call with the blocks verified, or None). On the host the views are the blocks
    themselves (one per K|V, layer and run of consecutive ids); a pool elsewhere (a GPU) is
    landed in a host buffer of the run, copied in afterwards, one copy per run of ids."""
    halves = [kv.kv[0], kv.kv[1]] if kv.kv is not None else [kv.k, kv.v]
    ids = list(block_ids)
    if halves[0].device.type == "cpu":
        return _views(halves, ids), None
    layers, _, heads, _, head_dim = halves[0].shape
    staging = torch.empty((2, layers, len(ids), heads, BLOCK_SIZE, head_dim),
                          dtype=halves[0].dtype, pin_memory=torch.cuda.is_available())

    def finish(n: int) -> None:
        for dst, src, m in paired_runs(ids[:n], range(n)):
            for c in (0, 1):
                halves[c][:, dst : dst + m].copy_(staging[c][:, src : src + m])

    return _views([staging[0], staging[1]], list(range(len(ids)))), finish


def _views(halves: Sequence[torch.Tensor], ids: Sequence[int]) -> Landing:
    """Blocks [lo, hi) of the run as byte views of `halves` (K, V: `[L, blocks, H, 16, D]`) at
    `ids[lo:hi]`, in CLBHN order: K then V, per layer, per run of consecutive ids."""
    raw = [h.view(torch.uint8).numpy() for h in halves]  # bfloat16 has no numpy dtype
    layers = raw[0].shape[0]

    def landing(lo: int, hi: int) -> list[memoryview]:
        runs = paired_runs(ids[lo:hi], range(lo, hi))
        return [r[layer, dst : dst + m].data.cast("B")
                for r in raw for layer in range(layers) for dst, _, m in runs]

    return landing
