"""`PrefixCache`: the facade the replica engine codes against (and the fleet tier T2).

Layering, top to bottom (vLLM v1 style): this facade (tensors, locking, the store queue) ->
`CacheManager` (keys, admission, placement, stats; pure) -> `BlockIndex` (radix index, tiers, ref
counts, eviction; pure) -> the slots of each tier (pure): T0 is the engine's own KV
(`PagedBlocks`, ref-counted `BlockRefs` shared with the sequences), T1 a host `TensorPool`.

The engine's path (one pool, no copies for T0): `prepare` (the lookup; the hit's T0 block ids,
placed in the sequence's table: `_share_prefix`) -> `fill` (the hit's T1 blocks, copied into the
sequence's fresh blocks one run at a time, then filed in T0 where they now are: `_copy_into`) ->
prefill the rest -> `finish` (the prompt's full blocks are indexed where they are:
`_store_blocks`; the hit released). When
the engine lacks room, `PagedBlocks.take` asks this cache to reclaim unreferenced cached blocks,
in the policy's victim order (demoted to T1 when it admits them, else dropped).

Thread-safe: every public method takes one lock (the device pool's, so the engine's allocations
and the cache's evictions are serialized), and request threads and a drain thread (or
`asyncio.to_thread(cache.drain_store_queue)`) may call it concurrently.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from prometheus_client.registry import CollectorRegistry

from kvfleet_runtime.cache._allocator import CachedSlots
from kvfleet_runtime.cache._block_index import BlockNode, Tier
from kvfleet_runtime.cache._config import CacheTuning, KVLayout
from kvfleet_runtime.cache._keys import (
    BLOCK_SIZE,
    BlockHash,
    CacheKey,
    PromptChain,
    usable_tokens,
)
from kvfleet_runtime.cache._manager import (
    BlockEvent,
    CacheManager,
    StoreOutcome,
    StorePlan,
)
from kvfleet_runtime.cache._metrics import CacheCollector
from kvfleet_runtime.cache._pool import (
    PagedBlocks,
    Pool,
    TensorPool,
    copy_runs,
    execute_moves,
    read_blocks_into,
    torch_dtype,
    write_blocks,
)
from kvfleet_runtime.cache._stats import CacheStats
from kvfleet_runtime.cache._store_queue import StoreQueue

__all__ = ["EvictedRun", "Hit", "Miss", "PinnedRun", "Prefix", "PrefixCache"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Hit:
    """A matched block-aligned prefix. Holds a ref on its blocks until `PrefixCache.release`."""

    matched_tokens: int
    blocks: tuple[BlockHash, ...]
    """Chain hashes of the matched blocks, root first."""
    tier: Tier
    """The coldest tier holding one of the blocks at lookup time (T1 means a copy from host)."""
    key: CacheKey
    _path: list[BlockNode] = field(repr=False)
    _released: bool = field(default=False, repr=False)


@dataclass(slots=True, eq=False)
class PinnedRun:
    """Blocks held where they lie for a reader outside the cache (a peer's one-sided read of
    the host pools: T2 over NIXL) until `PrefixCache.unpin`. A ref on every block, so none is
    freed, moved or overwritten meanwhile (`_block_index`'s invariant), and no lookup is counted
    (serving a peer is not a hit here)."""

    block_hashes: tuple[BlockHash, ...]
    slots: tuple[tuple[int, int], ...]
    """Where each block lies: (tier, block id), tier 0 for T0 (`PrefixCache.pools()[0]`), 1 for
    T1."""
    _path: list[BlockNode] = field(repr=False)
    _released: bool = field(default=False, repr=False)


@dataclass(slots=True, frozen=True)
class Miss:
    """No block of the prompt is cached: prefill everything."""


@dataclass(slots=True, eq=False)
class Prefix:
    """A request's prefix as `PrefixCache.prepare` placed it, held until `PrefixCache.finish`."""

    key: CacheKey
    kv: PagedBlocks
    hit: Hit | None
    """The lookup's hit (its refs held until `finish`), None on a miss."""
    table: list[int]
    """The hit's leading T0 blocks, shared: the head of the sequence's block table."""
    num_blocks: int
    """Usable matched blocks: `table`, then those `fill` copies in (the block holding the last
    prompt token is never among them, `usable_tokens`)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV is in the sequence's table once `fill` ran (block-aligned)."""
    tier: str | None = None
    """The coldest tier the placed KV came from ("t0", "t1"; None: nothing placed)."""
    chain: PromptChain | None = None
    """The prompt's chain, hashed once for the request: the lookup walked it, the tiers below
    the cache (`usable_chain`) and the prompt's store continue it."""
    finished: bool = False

    def usable_chain(self) -> list[BlockHash]:
        """The chain of the blocks any tier may supply (`usable_tokens`): what the tiers below
        the cache are asked for. Empty without a chain (a cache that could not hash it)."""
        if self.chain is None:
            return []
        return self.chain.upto(self.chain.num_usable)


@dataclass(slots=True, frozen=True)
class EvictedRun:
    """Blocks of one key the host tier dropped, parents before children, with their data (a
    copy, canonical layout `[num_layers, num_kv_heads, len(hashes) * 16, head_dim]`, on the
    host) and their sighting counts: what an eviction sink (T3) may keep."""

    key: CacheKey
    block_hashes: tuple[BlockHash, ...]
    sightings: tuple[int, ...]
    k: torch.Tensor
    v: torch.Tensor


@dataclass(slots=True)
class _Pending:
    """A queued write: its data is `k`/`v` (canonical tensors), or blocks `src_ids` of the
    engine's pool `src`, held (one ref each) until the write is done or dropped."""

    plan: StorePlan
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    src: PagedBlocks | None = None
    src_ids: list[int] = field(default_factory=list)

    def let_go(self) -> None:
        if self.src is not None:
            self.src.give_back(self.src_ids)
            self.src, self.src_ids = None, []


class PrefixCache:
    """Prefix KV cache of one replica: T0 (the engine's KV) and a T1 host pool behind a radix
    index."""

    def __init__(
        self,
        config: CacheTuning,
        layout: KVLayout,
        *,
        clock: Callable[[], float],
        device: str | torch.device = "cpu",
        registry: CollectorRegistry | None = None,
        metrics_prefix: str = "kvfleet_cache",
        device_kv: PagedBlocks | None = None,
    ) -> None:
        """`device_kv`: the engine's KV (`PagedKV`), which becomes T0: one pool for in-flight
        sequences and cached prefixes (`config.num_t0_blocks` must equal its block count).
        Without it, T0 is a pool of `num_t0_blocks` in the same layout that an engine can adopt
        (`Engine(..., kv=cache.device_kv)`) or that serves the cache alone."""
        self.config = config
        self.layout = layout
        self.dtype = torch_dtype(layout.dtype)
        if device_kv is not None:
            self._check_device_kv(device_kv, config)
            self.device = device_kv.k.device
            t0: PagedBlocks | None = device_kv
        else:
            self.device = torch.device(device)
            t0 = (
                PagedBlocks.zeros(layout, config.num_t0_blocks, self.device)
                if config.num_t0_blocks
                else None
            )
        self._manager = CacheManager(
            config,
            bytes_per_block=layout.bytes_per_block,
            clock=clock,
            t0_slots=CachedSlots(t0.refs) if t0 is not None else None,
        )
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._pools: tuple[PagedBlocks | None, TensorPool | None] = (
            t0,
            TensorPool(layout, config.num_t1_blocks, torch.device("cpu"), pin_memory=pin)
            if config.num_t1_blocks
            else None,
        )
        self._queue: StoreQueue[_Pending] = StoreQueue(config.store_queue_max_entries)
        # One lock for the device pool's allocator and the cache: an eviction frees a block and
        # copies it out (a demotion) before anyone can be handed that block.
        self._lock: threading.RLock = t0.lock if t0 is not None else threading.RLock()
        if t0 is not None:
            t0.reclaimer = self._reclaim
        self._listeners: list[Callable[[BlockEvent], None]] = []
        self._hit_listeners: list[Callable[[CacheKey, tuple[BlockHash, ...]], None]] = []
        self._eviction_sink: Callable[[EvictedRun], None] | None = None
        self._evicted_runs: list[EvictedRun] = []
        self._collector = CacheCollector(self._metrics_snapshot, metrics_prefix)
        if registry is not None:
            registry.register(self._collector)

    @property
    def device_kv(self) -> PagedBlocks | None:
        """T0: the device block pool this cache's T0 lives in (the engine's KV), or None."""
        return self._pools[0]

    # -- request path: the pair --------------------------------------------------------------

    def prepare(self, key: CacheKey, token_ids: Sequence[int], kv: PagedBlocks) -> Prefix:
        """The start of a request: look its prompt up (counted once), and place the hit's
        leading T0 blocks in `prefix.table`, shared (no copy; refs on the index and on `kv`).
        The engine then takes the rest of its table from `kv` and calls `fill`. The prompt's
        chain is hashed here once (`prefix.chain`), as far as the lookup needs it; the tiers
        below the cache and the store continue it. On an error nothing stays held."""
        chain = self._manager._chain(key, token_ids)
        hit = self._lookup(key, chain, len(token_ids))
        if not isinstance(hit, Hit):
            return Prefix(key, kv, None, [], 0, chain=chain)
        for callback in self._hit_listeners:
            try:
                callback(key, hit.blocks)
            except Exception:
                log.exception("cache hit listener failed")
        usable = min(hit.matched_tokens, usable_tokens(len(token_ids))) // BLOCK_SIZE
        try:
            shared = self._share_prefix(hit, kv, usable) if usable else []
        except BaseException:
            self.release(hit)
            raise
        return Prefix(key, kv, hit, shared, usable, chain=chain)

    def fill(self, prefix: Prefix, table: Sequence[int]) -> int:
        """Copy the hit's blocks that are not in `prefix.kv` (T1) into `table[len(prefix.table):
        prefix.num_blocks]` (the sequence's fresh blocks); returns `prefix.cached_tokens`, the
        tokens the engine resumes after. On an error the shared part still counts (raised after
        `prefix` says so): the caller recomputes the rest."""
        shared = len(prefix.table)
        prefix.cached_tokens = shared * BLOCK_SIZE
        prefix.tier = Tier.T0.label if shared else None
        hit = prefix.hit
        if hit is not None and shared < prefix.num_blocks:
            self._copy_into(hit, prefix.kv, table, shared, prefix.num_blocks)
            prefix.cached_tokens = prefix.num_blocks * BLOCK_SIZE
            prefix.tier = Tier(hit.tier).label
        return prefix.cached_tokens

    def finish(
        self,
        prefix: Prefix,
        token_ids: Sequence[int] | None = None,
        table: Sequence[int] | None = None,
    ) -> StoreOutcome | None:
        """The request's prompt is computed into `table`: offer its full blocks (`_store_blocks`,
        hit or miss: every offer counts a sighting) and release the hit. Without `token_ids`
        (cancelled, failed, cache switched): release only. Once per prefix; later calls do
        nothing. The sequence keeps its own holds on `table` until it gives them back."""
        if prefix.finished:
            return None
        prefix.finished = True
        try:
            n_full = len(token_ids) // BLOCK_SIZE * BLOCK_SIZE if token_ids is not None else 0
            if token_ids is None or table is None or n_full == 0:
                return None
            # The chain the lookup hashed, continued (the prompt is hashed once per request).
            chain = (prefix.chain.upto(n_full // BLOCK_SIZE)
                     if prefix.chain is not None and prefix.chain.num_blocks * BLOCK_SIZE == n_full
                     else None)
            return self._store_blocks(prefix.key, token_ids[:n_full], prefix.kv, table, chain)
        finally:
            if prefix.hit is not None:
                self.release(prefix.hit)

    # -- request path: the primitives ------------------------------------------------------

    def block_hashes(self, key: CacheKey, token_ids: Sequence[int]) -> list[BlockHash]:
        """The chain this cache files the full blocks of `token_ids` under (platform prefixes
        scoped as in `lookup`): what the fleet tier publishes, probes and fetches by. No lock:
        hashing reads only the config, and the memo tolerates concurrent chains."""
        hashes, _ = self._manager.hashes(key, token_ids)
        return list(hashes)

    def lookup(self, key: CacheKey, token_ids: Sequence[int]) -> Hit | Miss:
        """Longest cached block-aligned prefix of `token_ids` under `key`."""
        return self._lookup(key, self._manager._chain(key, token_ids), len(token_ids))

    def num_held(self, chain: Sequence[BlockHash], tenant: str | None = None) -> int:
        """How many leading blocks of `chain` this cache holds now, read from the index itself
        (no refs, no stats: serving peers is not a hit here); with `tenant`, only that tenant's
        and the platform's blocks count (a peer's held probe)."""
        with self._lock:
            return self._manager._num_held(chain, tenant)

    def pin(self, chain: Sequence[BlockHash], start_block: int = 0,
            max_blocks: int | None = None) -> PinnedRun | None:
        """Hold the blocks of `chain` this cache holds from `start_block` on (at most
        `max_blocks`), where they lie, until `unpin`; None when block `start_block` is not held.
        `chain` is the whole chain from the root (the match walks it from its first block)."""
        end = len(chain) if max_blocks is None else min(len(chain), start_block + max_blocks)
        with self._lock:
            path = self._manager.match(chain[:end])[start_block:]
            if not path:
                return None
            self._manager.acquire(path)
            return PinnedRun(tuple([n.block_hash for n in path]),
                             tuple([(int(n.tier), n.block_id) for n in path]), path)

    def unpin(self, run: PinnedRun) -> None:
        """The reader is done (or its lease ran out): the blocks become evictable again. Once
        per run; later calls do nothing."""
        with self._lock:
            if run._released:
                return
            run._released = True
            self._manager.release(run._path)

    def pools(self) -> tuple[PagedBlocks | None, TensorPool | None]:
        """The memory blocks lie in: T0 (the engine's KV) and T1 (host), None where a tier has
        no pool. What a one-sided reader registers once (`fleet.t2_nixl`), addressed by
        `PinnedRun.slots`."""
        return self._pools

    def _lookup(self, key: CacheKey, chain: PromptChain, num_tokens: int) -> Hit | Miss:
        with self._lock:
            path = self._manager.lookup(key, chain.walk(), num_tokens)
        if not path:
            return Miss()
        return Hit(
            matched_tokens=len(path) * BLOCK_SIZE,
            blocks=tuple([n.block_hash for n in path]),
            tier=Tier(path[-1].tier),
            key=key,
            _path=path,
        )

    def materialize(
        self, hit: Hit, *, tp_degree: int = 1, tp_rank: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the hit, `[num_layers, num_kv_heads // tp_degree, matched_tokens, head_dim]`
        on the cache's device, for rank `tp_rank` (heads h with h % tp_degree == tp_rank).

        T1 blocks are promoted into T0 first when T0 has room (one copy per run); the result is a
        fresh tensor, never a view of the pool, so it stays valid after `release`."""
        heads = self._heads(tp_degree, tp_rank)
        layout = self.layout
        with self._operation():
            self._check_live(hit)
            path = hit._path
            moves = self._manager._promote(path)
            self._capture_evicted()
            execute_moves(self._pools, moves)
            shape = (
                layout.num_layers,
                layout.num_kv_heads // tp_degree,
                hit.matched_tokens,
                layout.head_dim,
            )
            out_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            out_v = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._gather(path, out_k, out_v, heads)
        return out_k, out_v

    def release(self, hit: Hit) -> None:
        """End of the request: the hit's blocks become evictable again."""
        with self._lock:
            self._check_live(hit)
            hit._released = True
            self._manager.release(hit._path)

    def store(
        self, key: CacheKey, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> StoreOutcome:
        """Offer a prefilled prompt (`k`/`v` `[num_layers, num_kv_heads, len(token_ids),
        head_dim]`). Best effort and non-blocking: counts a sighting of every full block, queues
        the admissible new blocks, and returns at once; the copy happens in `drain_store_queue`.

        Call it after every prefill, hit or miss: sightings are how reuse is inferred. The queue
        keeps references to `k`/`v`, so the caller must not write into them afterwards."""
        self._check_kv(k, v, len(token_ids), "store")
        with self._lock:
            hashes, platform_blocks = self._manager.hashes(key, token_ids)
            plan = self._manager.plan_store(key, list(hashes), platform_blocks)
            if not isinstance(plan, StorePlan):
                return plan
            pending = _Pending(plan, k, v)
            dropped = self._queue.push(plan.priority, pending)
            if dropped is not None:
                self._manager._note_dropped(dropped.plan)
                dropped.let_go()
        return StoreOutcome.DROPPED if dropped is pending else StoreOutcome.QUEUED

    def _share_prefix(self, hit: Hit, kv: PagedBlocks, max_blocks: int) -> list[int]:
        """The block ids of the hit's leading T0 blocks (at most `max_blocks`), each with one
        more holder: the caller places them at the head of a sequence's block table and gives
        them back with `kv.give_back` at its end. No data moves. Empty when `kv` is not this
        cache's T0 pool (then `_copy_into` copies every block)."""
        with self._lock:
            self._check_live(hit)
            if not self._is_t0(kv):
                return []
            ids: list[int] = []
            for node in hit._path[:max_blocks]:
                if node.tier != Tier.T0:
                    break
                ids.append(node.block_id)
            kv.refs.share(ids)
            return ids

    def _copy_into(
        self, hit: Hit, kv: PagedBlocks, table: Sequence[int], start: int, stop: int
    ) -> int:
        """Copy the hit's blocks [start, stop) into the engine's blocks `table[start:stop]`
        (the sequence's own, freshly taken), one copy per run of consecutive ids on both sides;
        returns the number of copies per tensor. Blocks copied from T1 into this cache's T0 pool
        are then filed in T0 where they now are (a promotion without a second copy)."""
        if not 0 <= start <= stop <= min(len(hit._path), len(table)):
            raise ValueError(
                f"copy_into: need 0 <= start <= stop <= {min(len(hit._path), len(table))}, "
                f"got {start} and {stop}"
            )
        with self._lock:
            self._check_live(hit)
            nodes = hit._path[start:stop]
            dst = list(table[start:stop])
            # One pass over the nodes, by tier (plain ints: an IntEnum compare costs a call).
            by_tier: tuple[tuple[list[int], list[int]], ...] = (([], []), ([], []))
            for node, block in zip(nodes, dst, strict=True):
                src_ids, dst_ids = by_tier[node.tier]
                src_ids.append(node.block_id)
                dst_ids.append(block)
            num_copies = 0
            for pool, (src_ids, dst_ids) in zip(self._pools, by_tier, strict=True):
                if src_ids and pool is not None:
                    num_copies += copy_runs(pool, src_ids, kv, dst_ids)
            if (self._is_t0(kv) and self._manager._t0_enabled and nodes
                    and len(by_tier[Tier.T1][0]) == len(nodes)):
                parent = nodes[0].parent
                if parent is None or parent.tier == Tier.T0:
                    self._manager._promote_in_place(nodes, dst)
        return num_copies

    def _store_blocks(
        self,
        key: CacheKey,
        token_ids: Sequence[int],
        kv: PagedBlocks,
        table: Sequence[int],
        chain: list[BlockHash] | None = None,
    ) -> StoreOutcome:
        """Offer a prefilled prompt whose KV is in the engine's blocks `table` (the full blocks
        of `token_ids`; the caller never writes them again). When `kv` is this cache's T0, the
        new blocks are indexed where they are, at once (STORED: no copy; the sequence and the
        cache then share them). Otherwise (the prefix continues a T1 chain, or another pool) the
        write is queued like `store`'s, holding the blocks until it is done. `chain`: the
        prompt's chain when the lookup hashed it already (`finish`)."""
        with self._operation():
            if chain is None:
                hashes, platform_blocks = self._manager.hashes(key, token_ids)
                chain = list(hashes)
            else:
                platform_blocks = self._manager._platform_blocks(token_ids)
            plan = self._manager.plan_store(key, chain, platform_blocks)
            if not isinstance(plan, StorePlan):
                return plan
            if len(table) < len(plan.hashes):
                raise ValueError(
                    f"store_blocks: table has {len(table)} blocks, the prompt {len(plan.hashes)}"
                )
            ids = list(table[: len(plan.hashes)])
            if self._is_t0(kv) and self._manager._store_in_place(plan, ids) is not None:
                return StoreOutcome.STORED
            else:
                kv.share(ids)
                pending = _Pending(plan, src=kv, src_ids=ids)
                dropped = self._queue.push(plan.priority, pending)
                if dropped is not None:
                    self._manager._note_dropped(dropped.plan)
                    dropped.let_go()
                return StoreOutcome.DROPPED if dropped is pending else StoreOutcome.QUEUED

    # -- background ------------------------------------------------------------------------

    def drain_store_queue(self, max_entries: int | None = None) -> int:
        """Write pending stores into the pools, most valuable first; returns blocks written.
        Meant for a background thread or `asyncio.to_thread`; never called on the request path."""
        written = 0
        done = 0
        while max_entries is None or done < max_entries:
            # Pop under the cache lock: an `invalidate` between the pop and the write would
            # miss the popped plan and let it re-index blocks of the invalidated version.
            with self._operation():
                pending = self._queue.pop()
                if pending is None:
                    break
                done += 1
                try:
                    written += self._write(pending)
                finally:
                    pending.let_go()
        return written

    def _write(self, pending: _Pending) -> int:
        commit = self._manager.commit(pending.plan)
        try:
            self._capture_evicted()
            execute_moves(self._pools, commit.moves)
            first = commit.first_block
            for tier in (Tier.T0, Tier.T1):
                idx = [i for i, n in enumerate(commit.nodes) if n.tier == tier]
                if not idx:
                    continue
                pool = self._pools[tier]
                assert pool is not None
                ids = [commit.nodes[i].block_id for i in idx]
                if pending.src is not None:
                    src_ids = [pending.src_ids[first + i] for i in idx]
                    copy_runs(pending.src, src_ids, pool, ids)
                    continue
                k, v = pending.k, pending.v
                assert k is not None and v is not None
                # Nodes of one tier form a contiguous stretch of the chain (tiers are monotone).
                lo, hi = (first + idx[0]) * BLOCK_SIZE, (first + idx[-1] + 1) * BLOCK_SIZE
                write_blocks(pool, ids, k[:, :, lo:hi], v[:, :, lo:hi])
        finally:
            self._manager.finish_commit(commit)
        return len(commit.nodes)

    def _reclaim(self, num_blocks: int) -> None:
        """`PagedBlocks.take` found fewer than `num_blocks` free: finish pending writes (they
        hold blocks), then evict unreferenced cached T0 blocks in victim order until that many
        are free or nothing more can go (demotions copy to T1 first, under the lock, so no block
        is handed out before its data left)."""
        with self._operation():
            while (pending := self._queue.pop()) is not None:
                try:
                    self._write(pending)
                finally:
                    pending.let_go()
            moves = self._manager._reclaim(num_blocks)
            self._capture_evicted()
            execute_moves(self._pools, moves)

    # -- control plane ---------------------------------------------------------------------

    def invalidate(self, weights_digest: str) -> int:
        """Make every block of a weights version unreachable now (and its slots reclaimable, at
        once or at the release of the hits that hold them); drops its pending writes. Returns the
        number of blocks removed from the index."""
        with self._operation():
            removed = self._manager._invalidate(weights_digest)
            for pending in self._queue.remove_if(
                lambda p: p.plan.key.weights_digest == weights_digest
            ):
                pending.let_go()
        return removed

    def stats(self, tenant: str | None = None) -> CacheStats:
        with self._lock:
            return self._manager.stats(tenant, store_queue_len=len(self._queue))

    # -- fleet-tier hooks ------------------------------------------------------------------

    def add_listener(self, callback: Callable[[BlockEvent], None]) -> None:
        """Called (outside the cache lock, on the thread that caused it) with "stored" events for
        blocks written and "removed" events for blocks dropped or invalidated: what a global hint
        index publishes and withdraws. Demotions T0 -> T1 keep a block on the host: no event."""
        self._listeners.append(callback)

    def add_hit_listener(self, callback: Callable[[CacheKey, tuple[BlockHash, ...]], None]
                         ) -> None:
        """Called (outside the cache lock, on the engine's thread: keep it cheap) with the key and
        the blocks of every hit `prepare` finds: what a hint index keeps alive while it is used
        (the fleet tier's refresh). A failing callback is logged, never the request's."""
        self._hit_listeners.append(callback)

    @property
    def t1_enabled(self) -> bool:
        return bool(self.config.num_t1_blocks) and self._manager._t1_enabled

    def set_t1_enabled(self, enabled: bool) -> int:
        """T1 on or off, live (the fleet config's `tiers.t1_host`). Off: every T1 block becomes
        unreachable at once and its slot is freed (at the release of the in-flight hits that
        hold it, which keep reading correct data meanwhile); stores and demotions stop using T1.
        Returns the blocks removed. The pool stays allocated, so turning it on again is free."""
        with self._operation():
            return self._manager._set_t1_enabled(enabled)

    @property
    def t0_enabled(self) -> bool:
        """T0 is here and on (the fleet config's `tiers.t0_device`)."""
        return self._pools[0] is not None and self._manager._t0_enabled

    def set_t0_enabled(self, enabled: bool) -> tuple[int, int]:
        """T0 on or off, live (the fleet config's `tiers.t0_device`). Off: stores are no longer
        indexed in place (a prompt's blocks are offered to T1 by copy, as without a T0, or not at
        all when T1 is off too), lookups no longer hit T0, and every cached T0 block leaves T0
        at once: demoted to T1 by copy when T1 is on and its policy takes it, else unreachable
        and freed (a sequence that still holds one in its table keeps reading it until it
        ends). On: stores are indexed in place again. Returns (blocks demoted to T1, blocks
        removed from the index). The engine's pool is untouched: T0 off only means the cache
        keeps none of it."""
        with self._operation():
            demoted, removed, moves = self._manager._set_t0_enabled(enabled)
            # Copy out before the lock is released: the freed T0 slots may be taken right after.
            self._capture_evicted()
            execute_moves(self._pools, moves)
        return demoted, removed

    def set_eviction_sink(self, sink: Callable[[EvictedRun], None] | None) -> None:
        """Hand every block the host tier drops (T1, or T0 without a T1) to `sink`, with a copy
        of its data, outside the cache lock on the thread that caused the eviction: the next
        tier's way in (T3). The sink must be quick (queue, don't write). None detaches it."""
        with self._lock:
            self._eviction_sink = sink
            self._manager._evicted = [] if sink is not None else None

    def read_blocks(
        self,
        hashes: Sequence[BlockHash],
        *,
        device: str | torch.device | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Export blocks held here, by chain hash, in canonical layout `[num_layers,
        num_kv_heads, len(hashes) * 16, head_dim]`; None unless every block is held.

        `out=(k, v)`: gather into these tensors (that shape, or `[num_layers, num_kv_heads,
        len(hashes), 16, head_dim]` for outputs whose blocks cannot merge into one token axis,
        e.g. views of a T2 send buffer in another wire order; the cache's dtype, on `device`
        when given) instead of fresh ones, and return them. Reusing buffers avoids first-touch
        page faults, which cost more than the copy itself. On None (or an error) `out` is
        untouched."""
        layout = self.layout
        shape = (
            layout.num_layers,
            layout.num_kv_heads,
            len(hashes) * BLOCK_SIZE,
            layout.head_dim,
        )
        if out is not None:
            target = out[0].device
            split = (*shape[:2], len(hashes), BLOCK_SIZE, shape[3])
            for name, t in zip(("k", "v"), out, strict=True):
                if tuple(t.shape) not in (shape, split) or t.dtype != self.dtype:
                    raise ValueError(
                        f"read_blocks: out {name} must be {self.dtype} {shape}, "
                        f"got {t.dtype} {tuple(t.shape)}"
                    )
                if t.device != target or (device is not None and t.device != torch.device(device)):
                    raise ValueError(f"read_blocks: out {name} is on {t.device}, not {device}")
            if out[0].data_ptr() == out[1].data_ptr() and out[0].numel():
                raise ValueError("read_blocks: out k and v must not share storage")
        else:
            target = self.device if device is None else torch.device(device)
        with self._lock:
            nodes = [self._manager._get(h) for h in hashes]
            path = [n for n in nodes if n is not None]
            if len(path) != len(hashes) or not path:
                return None
            if out is None:
                out_k = torch.empty(shape, dtype=self.dtype, device=target)
                out_v = torch.empty(shape, dtype=self.dtype, device=target)
            else:
                out_k, out_v = out
            self._gather(path, out_k, out_v, slice(None))
        return out_k, out_v

    def _import_blocks(
        self, key: CacheKey, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor
    ) -> int:
        """Insert KV fetched from a peer for the full blocks of `token_ids` (canonical layout as
        in `store`). Synchronous: it was fetched because a request wants it now. Counts as one
        sighting and then competes for room like any write. Returns blocks written."""
        self._check_kv(k, v, len(token_ids), "import_blocks")
        with self._operation():
            hashes, platform_blocks = self._manager.hashes(key, token_ids)
            plan = self._manager.plan_import(key, list(hashes), platform_blocks)
            if plan is None:
                return 0
            return self._write(_Pending(plan, k, v))

    # -- internals -------------------------------------------------------------------------

    def _gather(
        self, path: list[BlockNode], out_k: torch.Tensor, out_v: torch.Tensor, heads: slice
    ) -> int:
        """Copy the path's blocks into the outputs, one copy per run of consecutive slots."""
        num_copies = 0
        for tier in (Tier.T0, Tier.T1):
            positions = [i for i, n in enumerate(path) if n.tier == tier]
            if positions:
                pool: Pool | None = self._pools[tier]
                assert pool is not None
                ids = [path[i].block_id for i in positions]
                num_copies += read_blocks_into(pool, out_k, out_v, ids, positions, heads)
        return num_copies

    def _is_t0(self, kv: PagedBlocks) -> bool:
        """`kv` is this cache's T0: the same block pool (one allocator), whatever wraps it."""
        t0 = self._pools[0]
        return t0 is not None and kv.refs is t0.refs

    def _check_device_kv(self, kv: PagedBlocks, config: CacheTuning) -> None:
        layout = self.layout
        expected = (layout.num_layers, kv.num_blocks, layout.num_kv_heads, BLOCK_SIZE,
                    layout.head_dim)
        for name, t in (("k", kv.k), ("v", kv.v)):
            if tuple(t.shape) != expected or t.dtype != self.dtype:
                raise ValueError(
                    f"device_kv: {name} must be {self.dtype} {expected} [layers, blocks, "
                    f"kv_heads, {BLOCK_SIZE}, head_dim], got {t.dtype} {tuple(t.shape)}"
                )
        if config.num_t0_blocks != kv.num_blocks:
            raise ValueError(
                f"T0 is the engine's KV: num_t0_blocks must equal its {kv.num_blocks} blocks, "
                f"got {config.num_t0_blocks}"
            )
        if kv.reclaimer is not None:
            raise ValueError("device_kv already belongs to another PrefixCache")

    def _heads(self, tp_degree: int, tp_rank: int) -> slice:
        n = self.layout.num_kv_heads
        if tp_degree <= 0 or n % tp_degree:
            raise ValueError(f"tp_degree must divide num_kv_heads={n}, got {tp_degree}")
        if not 0 <= tp_rank < tp_degree:
            raise ValueError(f"tp_rank must be in [0, {tp_degree}), got {tp_rank}")
        return slice(tp_rank, None, tp_degree)

    def _check_live(self, hit: Hit) -> None:
        if not isinstance(hit, Hit):
            raise ValueError(f"expected a Hit, got {hit!r}")
        if hit._released:
            raise ValueError(f"hit already released: {hit!r}")

    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, num_tokens: int, what: str) -> None:
        layout = self.layout
        expected = (layout.num_layers, layout.num_kv_heads, num_tokens, layout.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{what}: {name} must have shape {expected} "
                    f"[layers, kv_heads, tokens, head_dim], got {tuple(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"{what}: {name} must be {self.dtype}, got {t.dtype}")

    def _capture_evicted(self) -> None:
        """Copy out what the last index operation dropped, before its moves reuse the slots."""
        evicted = self._manager._drain_evicted()
        if not evicted or self._eviction_sink is None:
            return
        by_key: dict[CacheKey, list[BlockNode]] = {}
        # Dropped leaf first: reversed, a parent precedes its children (a run reads root first).
        for node, _ in reversed(evicted):
            by_key.setdefault(node.namespace.key, []).append(node)
        tier = evicted[0][1]
        pool = self._pools[tier]
        assert pool is not None
        layout = self.layout
        for key, nodes in by_key.items():
            shape = (layout.num_layers, layout.num_kv_heads, len(nodes) * BLOCK_SIZE,
                     layout.head_dim)
            k = torch.empty(shape, dtype=self.dtype)
            v = torch.empty(shape, dtype=self.dtype)
            read_blocks_into(pool, k, v, [n.block_id for n in nodes], range(len(nodes)),
                             slice(None))
            hashes = tuple(n.block_hash for n in nodes)
            sightings = tuple(self._manager._sightings(hashes))
            self._evicted_runs.append(EvictedRun(key, hashes, sightings, k, v))

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """One operation under the cache lock: the block events it caused go to the listeners,
        and what the host tier dropped to the eviction sink, once the lock is released (even
        when it fails: a withdrawal must reach the hint index)."""
        self._lock.acquire()
        try:
            yield
        finally:
            try:
                events = self._manager.drain_events()
            finally:
                self._lock.release()
            self._dispatch(events)

    def _dispatch(self, events: list[BlockEvent]) -> None:
        for event in events:
            for callback in self._listeners:
                callback(event)
        if self._evicted_runs:
            with self._lock:
                runs, self._evicted_runs = self._evicted_runs, []
                sink = self._eviction_sink
            if sink is not None:
                for run in runs:
                    sink(run)

    def _metrics_snapshot(self) -> tuple[CacheStats, dict[str, CacheStats]]:
        with self._lock:
            qlen = len(self._queue)
            total = self._manager.stats(None, store_queue_len=qlen)
            per_tenant = {
                t: self._manager.stats(t, store_queue_len=qlen)
                for t in self._manager._tenant_names()
            }
        return total, per_tenant
