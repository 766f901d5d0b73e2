"""The pure cache manager: keys -> hashes -> index, admission, placement, stats and events.

Everything the cache decides, without tensors, and the one place that wires the policy to the
index: `Admission` (`_admission.py`) decides what is worth storing and which eviction ranking is in
use; the `BlockIndex` (blocks, chains, refs, tiers) asks that ranking's `EvictionPolicy`
(`_eviction.py`) for victims. The `PrefixCache` facade adds the pools and the copies, and the
lab's hit-rate simulator drives this same class with
precomputed hashes, so the simulated policy is the shipped policy. Not thread-safe by itself: the
facade serializes calls under its lock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvfleet_runtime.cache._admission import Admission, Placement, ThrashDetector, place
from kvfleet_runtime.cache._allocator import Slots
from kvfleet_runtime.cache._block_index import BlockIndex, BlockNode
from kvfleet_runtime.cache._config import CacheTuning
from kvfleet_runtime.cache._eviction import chain_bound, floors
from kvfleet_runtime.cache._ghosts import AdaptiveRanking, ghost_rankings
from kvfleet_runtime.cache._keys import (
    BLOCK_SIZE,
    PLATFORM_TENANT,
    BlockHash,
    CacheKey,
    ChainMemo,
    PromptChain,
    iter_block_hashes,
    key_digest,
    platform_key,
    validate_weights_digest,
)
from kvfleet_runtime.cache._moves import Move, Plan, Tier
from kvfleet_runtime.cache._sketch import CountMinSketch
from kvfleet_runtime.cache._stats import CacheStats, TenantStats, TierStats

__all__ = [
    "BlockEvent",
    "CacheManager",
    "Commit",
    "StoreOutcome",
    "StorePlan",
    "block_events",
    "check_key",
]


class StoreOutcome(enum.Enum):
    QUEUED = "queued"
    RESIDENT = "resident"
    """Every admissible block is already cached: nothing to write."""
    REFUSED = "refused"
    """Not seen often enough yet (one-shot so far): not worth a queue slot."""
    DROPPED = "dropped"
    """The store queue was full of more valuable writes."""
    STORED = "stored"
    """Indexed at once: the blocks were already in T0 (the engine's KV), nothing to copy."""


@dataclass(slots=True, frozen=True)
class BlockEvent:
    """What a global hint index needs to publish ("stored") or withdraw ("removed")."""

    kind: Literal["stored", "removed"]
    key: CacheKey
    block_hashes: tuple[BlockHash, ...]


@dataclass(slots=True)
class StorePlan:
    """An admitted write: blocks [start_block, len(hashes)) of the chain `hashes`."""

    key: CacheKey
    hashes: list[BlockHash]
    start_block: int
    platform_blocks: int
    placement: Placement
    priority: int
    counts: Sequence[int] = ()
    """The sketch's estimate of each block of `hashes` when the plan was made (empty: unknown),
    in sketch epoch `epoch`: floors the eviction ranking keeps on the new nodes."""
    epoch: int = -1


@dataclass(slots=True)
class Commit:
    """Result of committing a plan: carry out `moves` first, then write `nodes`' data, then call
    `CacheManager.finish_commit(commit)` (the nodes are referenced until then)."""

    nodes: list[BlockNode]
    first_block: int
    """Index in the chain of nodes[0], i.e. the token offset is first_block * BLOCK_SIZE."""
    moves: list[Move] = field(default_factory=list)


def block_events(
    kind: Literal["stored", "removed"], nodes: Iterable[BlockNode]
) -> list[BlockEvent]:
    """`nodes`' blocks as events of `kind`, one per key, keys and blocks in the nodes' order."""
    by_key: dict[CacheKey, list[BlockHash]] = {}
    last: CacheKey | None = None
    hashes: list[BlockHash] = []
    for node in nodes:
        key = node.namespace.key
        if key is not last:  # runs of one namespace (a chain evicted leaf first): one probe
            hashes = by_key.setdefault(key, [])
            last = key
        hashes.append(node.block_hash)
    return [BlockEvent(kind, key, tuple(hashes)) for key, hashes in by_key.items()]


def check_key(key: CacheKey) -> CacheKey:
    if isinstance(key, CacheKey) and key.tenant_id == PLATFORM_TENANT:
        raise ValueError(
            f"tenant_id {PLATFORM_TENANT!r} is reserved for allow-listed platform "
            f"prefixes, got key {key!r}"
        )
    key_digest(key)  # validates every field once per distinct key (cached)
    return key


class CacheManager:
    def __init__(
        self,
        config: CacheTuning,
        *,
        bytes_per_block: int,
        clock: Callable[[], float],
        t0_slots: Slots | None = None,
    ) -> None:
        """`t0_slots`: T0 is the engine's KV (see `BlockIndex`)."""
        self._config = config
        self._bytes_per_block = bytes_per_block
        self._clock = clock
        self._sketch = CountMinSketch(config.sketch_width, config.sketch_depth)
        capacity = config.num_t0_blocks + config.num_t1_blocks
        sample = 1
        while capacity // sample > config.ghost_max_blocks:
            sample *= 2
        ranking = AdaptiveRanking(
            ghost_rankings(capacity, config.eviction_rankings, sample=sample),
            decay=config.ranking_decay,
            margin=config.ranking_margin,
        )
        thrash = ThrashDetector(
            ratio=config.thrash_ratio,
            window_s=config.thrash_window_s,
            sustain_s=config.thrash_sustain_s,
            min_blocks=config.thrash_min_blocks,
        )
        self._admission = Admission(
            self._sketch, ranking, thrash, admit_min_sightings=config.admit_min_sightings
        )
        self._index = BlockIndex(
            (config.num_t0_blocks, config.num_t1_blocks),
            self._admission.eviction(),
            pin_limit=int(config.pin_max_fraction * config.num_t0_blocks),
            t0_slots=t0_slots,
        )
        self._store_max_blocks = max(
            config.store_min_blocks,
            int(config.store_max_fraction * (config.num_t0_blocks + config.num_t1_blocks)),
        )
        """New blocks one store may write beyond the free room (`store_max_fraction`)."""
        self._memo = ChainMemo(config.hash_memo_entries) if config.hash_memo_entries else None
        self._events: list[BlockEvent] = []
        self._evicted: list[tuple[BlockNode, Tier]] | None = None
        """With a list here (an eviction sink is attached), blocks the host tier drops (T1, or
        T0 when there is no T1) are collected for the next tier, leaf first, slots still intact
        until the pending moves run (`drain_evicted`)."""
        self._tenants: dict[str, TenantStats] = {}
        # Longest first, so the longest allow-listed prefix a request starts with wins.
        self._platform = sorted(config.platform_prefixes, key=len, reverse=True)

    # -- keys ------------------------------------------------------------------------------

    def _platform_blocks(self, token_ids: Sequence[int]) -> int:
        for prefix in self._platform:
            n = len(prefix)
            if len(token_ids) >= n and tuple(token_ids[:n]) == prefix:
                return n // BLOCK_SIZE
        return 0

    def hashes(
        self, key: CacheKey, token_ids: Sequence[int], *, lookup: bool = False
    ) -> tuple[Iterable[BlockHash], int]:
        """The lazy chain of `token_ids` and its platform block count. A `lookup` adds the steps
        it takes to the memo (the blocks the index holds, plus one); everything else reads it."""
        check_key(key)
        platform_blocks = self._platform_blocks(token_ids)
        hashes = iter_block_hashes(
            key, token_ids, platform_blocks=platform_blocks, memo=self._memo, remember=lookup
        )
        return hashes, platform_blocks

    def _chain(self, key: CacheKey, token_ids: Sequence[int]) -> PromptChain:
        """The chain of `token_ids`' full blocks for one request, computed as far as it is used
        (`PromptChain`): its lookup walks it, everything after continues it."""
        check_key(key)
        return PromptChain(key, token_ids, platform_blocks=self._platform_blocks(token_ids),
                           memo=self._memo)

    def _tenant(self, tenant_id: str) -> TenantStats:
        stats = self._tenants.get(tenant_id)
        if stats is None:
            stats = self._tenants[tenant_id] = TenantStats()
        return stats

    # -- lookup ----------------------------------------------------------------------------

    def lookup(
        self,
        key: CacheKey,
        hashes: Iterable[BlockHash],
        num_tokens: int,
        *,
        num_local_tokens: int = 0,
    ) -> list[BlockNode]:
        """The longest cached chain along `hashes`, referenced (release it with `release`).

        `num_local_tokens`: a prefix the engine already holds in its own KV (vLLM's prefix
        cache, when kvfleet runs as its connector); only matched tokens beyond it count as
        hits, so the two caches' hit rates add up instead of counting those tokens twice."""
        path = self._index.match(hashes)
        stats = self._tenant(key.tenant_id)
        stats.num_lookups += 1
        stats.num_lookup_tokens += num_tokens
        if path:
            self._index.acquire(path)
            matched = len(path) * BLOCK_SIZE - num_local_tokens
            if matched > 0:
                stats.num_hits += 1
                stats.num_matched_tokens += matched
        return path

    def release(self, path: list[BlockNode]) -> None:
        freed = self._index.release(path)
        # Blocks of an invalidated version were withdrawn from the hint index at invalidation.
        assert all(not n.namespace.valid for n in freed)

    def match(self, hashes: Iterable[BlockHash]) -> list[BlockNode]:
        """The longest cached chain along `hashes`, from the first block on: no refs, no stats."""
        return self._index.match(hashes)

    def acquire(self, path: list[BlockNode]) -> None:
        """Refs on a matched path without counting a lookup (a re-admission, a peer's read);
        `release` drops them."""
        self._index.acquire(path)

    def _get(self, block_hash: BlockHash) -> BlockNode | None:
        """The indexed block with this chain hash, if any (no refs)."""
        return self._index.get(block_hash)

    def _num_held(self, hashes: Iterable[BlockHash], tenant: str | None = None) -> int:
        """Leading blocks of the chain `hashes` held now (no refs, no stats); with `tenant`,
        only blocks stored for that tenant or for the platform count (a peer's held probe:
        knowing another tenant's hashes reveals nothing)."""
        path = self._index.match(hashes)
        if tenant is None:
            return len(path)
        for i, node in enumerate(path):
            if node.namespace.key.tenant_id not in (tenant, PLATFORM_TENANT):
                return i
        return len(path)

    def _sightings(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The sketch's current sighting estimate of each block."""
        return self._sketch.estimate_many(hashes)

    def num_referenced_blocks(self) -> int:
        """Indexed blocks some request, write or transfer still references."""
        return sum(1 for n in self._index.nodes() if n.ref_count)

    @property
    def _t0_enabled(self) -> bool:
        return self._index.t0_enabled

    @property
    def _t1_enabled(self) -> bool:
        return self._index.t1_enabled

    # -- store -----------------------------------------------------------------------------

    def plan_store(
        self, key: CacheKey, hashes: list[BlockHash], platform_blocks: int = 0
    ) -> StorePlan | StoreOutcome:
        """Count one sighting of each block and decide what, if anything, is worth writing."""
        stats = self._tenant(key.tenant_id)
        stats.num_store_requests += 1
        stats.num_blocks_offered += len(hashes)
        counts = self._admission.count(hashes, self._clock())
        resident = self._index.match(hashes)
        if resident:
            # A sighting: the ranking counts the resident blocks at these counts from now on.
            self._index.touch(resident, floors(counts[: len(resident)], self._sketch.num_resets))
        decision = self._admission.decide(hashes, counts, len(resident))
        if decision.ranking_changed:
            self._index.set_policy(self._admission.eviction())
        stats.num_admissions_refused += decision.num_refused
        admitted = decision.num_blocks
        if admitted <= len(resident):
            return StoreOutcome.RESIDENT if resident else StoreOutcome.REFUSED
        stats.num_first_sighting_admissions += decision.num_first_sightings
        # Under a count ranking, beyond the cap (or the free room, whichever is more) the rest of
        # an admissible prefix waits for its next sighting: one prompt must not flush the counted
        # prefixes. Not a refusal. Under plain recency the ghosts found that the next request
        # re-uses what was just sent: the whole prompt is stored, as vLLM does (capped there, the
        # Mooncake quick run's 1% hit 0.95% against vLLM's 1.02%; uncapped 1.03%).
        if self._admission.ranking.strict:
            free = sum(alloc.num_free for alloc in self._index.allocators)
            admitted = min(admitted, len(resident) + max(self._store_max_blocks, free))
        sightings = counts[admitted - 1]
        cfg = self._config
        placement = place(
            sightings,
            admitted * self._bytes_per_block,
            admit_min_sightings=cfg.admit_min_sightings,
            hot_min_sightings=cfg.hot_min_sightings,
            pin_max_bytes=cfg.pin_max_bytes,
            thrashing=decision.thrashing,
        )
        priority = admitted * BLOCK_SIZE * sightings
        return StorePlan(
            key, hashes[:admitted], len(resident), platform_blocks, placement, priority,
            counts, self._sketch.num_resets,
        )

    def _note_dropped(self, plan: StorePlan) -> None:
        self._tenant(plan.key.tenant_id).num_store_drops += 1

    def plan_import(
        self,
        key: CacheKey,
        chain: list[BlockHash],
        platform_blocks: int,
        *,
        start_block: int | None = None,
    ) -> StorePlan | None:
        """The one import policy, for KV fetched from a peer (T2) or read back from NVMe (T3)
        because a request wants it now: every block of `chain` counts one sighting, and the
        blocks beyond the resident prefix are written without admission (they compete for room
        like any write). None when nothing is left to write, or when the resident prefix is
        not `start_block` blocks long (the chain changed since the fetch was planned)."""
        counts = chain_bound([self._sketch.increment(h) for h in chain])
        resident = self._index.match(chain)
        for node, floor in zip(resident, floors(counts, self._sketch.num_resets), strict=False):
            node.floor = floor  # a sighting, as in `plan_store`
        start = len(resident)
        if start == len(chain) or (start_block is not None and start != start_block):
            return None
        return StorePlan(
            key, chain, start, platform_blocks, Placement.REUSED, 0, counts,
            self._sketch.num_resets,
        )

    def commit(self, plan: StorePlan) -> Commit:
        """Index the plan's new blocks (as many as fit) and say where their data goes."""
        index = self._index
        resident = index.match(plan.hashes)
        start = len(resident)
        parent = resident[-1] if resident else None
        if (plan.placement is Placement.PINNED and index.allocators[Tier.T0].num_blocks
                and index.t0_enabled):
            tier, pinned = Tier.T0, True
        elif index.allocators[Tier.T1].num_blocks and index.t1_enabled:
            tier, pinned = Tier.T1, False
        else:
            tier, pinned = Tier.T0, False
        commit = Commit([], start)
        # Blocks a segment demotes stay held until the last segment is planned: the next
        # segment's evictions must not drop one before the moves have copied it.
        held: list[BlockNode] = []
        for key, lo, hi in _segments(plan, start):
            if lo >= hi:
                continue
            nodes, moves = index.insert(
                index.namespace(key), parent, plan.hashes[lo:hi], tier=tier, pinned=pinned,
                held=held, floors=self._floors(plan, lo, hi),
            )
            self._after(moves)
            commit.moves.extend(moves.moves)
            commit.nodes.extend(nodes)
            if nodes:
                self._events.append(BlockEvent("stored", key, tuple(n.block_hash for n in nodes)))
                parent = nodes[-1]
            if len(nodes) < hi - lo:
                break
        index.release_held(held)
        self._tenant(plan.key.tenant_id).num_blocks_stored += len(commit.nodes)
        return commit

    def _store_in_place(self, plan: StorePlan, block_ids: Sequence[int]) -> int | None:
        """Index the plan's new blocks where they already are, done at once: `block_ids[i]` is
        the engine's T0 block holding chain block i; nothing to write, so the nodes are created
        unreferenced and the chain's leaf is queued for eviction, as `commit` then
        `finish_commit` would leave them (without a pass over the nodes to take and drop refs).
        Returns the blocks indexed; None when they cannot be indexed in place (the resident
        prefix ends in T1, or a block is already cached): then `commit` copies them instead."""
        index = self._index
        if not index.t0_enabled:
            return None  # T0 off: the prompt is offered to T1 by copy, as without a T0
        resident = index.match(plan.hashes)
        start = len(resident)
        parent = resident[-1] if resident else None
        if parent is not None and parent.tier != Tier.T0:
            return None
        slots = index.allocators[Tier.T0]
        if not slots.all_free(block_ids[start : len(plan.hashes)]):
            return None
        pinned = plan.placement is Placement.PINNED
        num_stored = 0
        for key, lo, hi in _segments(plan, start):
            if lo >= hi:
                continue
            nodes = index.adopt(
                index.namespace(key), parent, plan.hashes[lo:hi], block_ids[lo:hi], pinned=pinned,
                floors=self._floors(plan, lo, hi), referenced=False,
            )
            num_stored += len(nodes)
            # `adopt` indexed exactly these hashes, in order.
            self._events.append(BlockEvent("stored", key, tuple(plan.hashes[lo:hi])))
            parent = nodes[-1]
        if parent is not None and num_stored:
            index.push_leaf(parent)  # after the last segment: its leaf is the chain's
        self._tenant(plan.key.tenant_id).num_blocks_stored += num_stored
        return num_stored

    def _floors(self, plan: StorePlan, lo: int, hi: int) -> list[int]:
        """The floors of chain blocks [lo, hi) (`floors`), none when the plan's counts are
        from an earlier sketch epoch."""
        if plan.epoch == self._sketch.num_resets and len(plan.counts) >= hi:
            return floors(plan.counts[lo:hi], plan.epoch)
        return []

    def _reclaim(self, num_free: int) -> list[Move]:
        """Make room in T0 for in-flight work (`BlockIndex.reclaim`); the demotion copies."""
        plan = self._index.reclaim(num_free)
        self._after(plan)
        if self._evicted is None:  # else the eviction sink still reads the dropped nodes
            self._index.recycle(plan.dropped)
        return plan.moves

    def _promote_in_place(self, nodes: Sequence[BlockNode], block_ids: Sequence[int]) -> None:
        self._index.promote_in_place(nodes, block_ids)

    def finish_commit(self, commit: Commit) -> None:
        self._index.release(commit.nodes)

    # -- replay (the lab's policy replays and fleet simulator drive the shipped policy here) --

    def replay(self, key: CacheKey, hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """One request without tensors: look up (counted in the stats) and release, then store
        what admission lets in, committed at once (an always-drained store queue); block events
        are dropped. Returns the matched blocks."""
        path = self.lookup(key, hashes, num_tokens)
        self.release(path)
        plan = self.plan_store(key, list(hashes))
        if isinstance(plan, StorePlan):
            self.finish_commit(self.commit(plan))
        self._events.clear()
        return len(path)

    def num_cached_blocks(self, hashes: Iterable[BlockHash]) -> int:
        """Blocks of the chain `hashes` cached now, from the first on; no reference, no stats."""
        return len(self._index.match(hashes))

    def _promote(self, path: list[BlockNode]) -> list[Move]:
        plan = self._index.promote(path)
        self._after(plan)
        return plan.moves

    def _after(self, plan: Plan) -> None:
        """Account for the blocks an operation dropped and queue their withdrawal events."""
        if not plan.dropped:
            return
        self._admission.note_dropped(len(plan.dropped), self._clock())
        if self._evicted is not None:
            t1 = self._index.allocators[Tier.T1].num_blocks and self._index.t1_enabled
            last = Tier.T1 if t1 else Tier.T0
            self._evicted.extend(
                (node, last) for node, tier in zip(plan.dropped, plan.dropped_from, strict=True)
                if tier == last
            )
        self._withdraw(plan.dropped)

    def _withdraw(self, nodes: Iterable[BlockNode], *, invalidated: bool = False) -> None:
        """The one way blocks leave the hint index: a "removed" event per key, each block
        counted against its tenant (an eviction, or an invalidation)."""
        for event in block_events("removed", nodes):
            stats = self._tenant(event.key.tenant_id)
            if invalidated:
                stats.num_invalidated += len(event.block_hashes)
            else:
                stats.num_evictions += len(event.block_hashes)
            self._events.append(event)

    # -- invalidation and stats ------------------------------------------------------------

    def _invalidate(self, weights_digest: str) -> int:
        validate_weights_digest(weights_digest)
        stale = [
            n for n in self._index.nodes() if n.namespace.key.weights_digest == weights_digest
        ]
        num_unindexed, _ = self._index.invalidate(weights_digest)
        self._withdraw(stale, invalidated=True)
        return num_unindexed

    def _set_t1_enabled(self, enabled: bool) -> int:
        """The fleet config's T1 toggle. Off drains T1 (see `BlockIndex.disable_t1`) and
        withdraws its blocks from the hint index; on hands out T1 slots again. Returns the
        blocks removed from the index."""
        if enabled:
            self._index.t1_enabled = True
            return 0
        if not self._index.t1_enabled:
            return 0
        gone = self._index.disable_t1()
        self._withdraw(gone)
        return len(gone)

    def _set_t0_enabled(self, enabled: bool) -> tuple[int, int, list[Move]]:
        """The fleet config's T0 toggle. Off drains T0 (see `BlockIndex.disable_t0`): blocks
        demoted to T1 stay reachable (no event), removed ones are withdrawn from the hint index.
        On files new blocks in T0 again. Returns (blocks demoted, blocks removed, the moves to
        carry out: the demotion copies)."""
        if enabled:
            self._index.t0_enabled = True
            return 0, 0, []
        if not self._index.t0_enabled:
            return 0, 0, []
        plan, gone = self._index.disable_t0()
        self._after(plan)  # T1 blocks evicted to make room for the demotions
        self._withdraw(gone)
        num_demoted = sum(1 for m in plan.moves if m.src_tier == Tier.T0)
        return num_demoted, len(gone), plan.moves

    def _drain_evicted(self) -> list[tuple[BlockNode, Tier]]:
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events

    def stats(self, tenant: str | None = None, *, store_queue_len: int = 0) -> CacheStats:
        resident: dict[str, int] = {}
        for ns in self._index.namespaces():
            resident[ns.key.tenant_id] = resident.get(ns.key.tenant_id, 0) + ns.num_blocks
        totals = TenantStats()
        for name, tenant_stats in self._tenants.items():
            if tenant is None or name == tenant:
                totals.add(tenant_stats)
        totals.num_blocks = sum(
            n for name, n in resident.items() if tenant is None or name == tenant
        )
        totals.num_bytes = totals.num_blocks * self._bytes_per_block
        tiers = []
        for tier in Tier:
            alloc = self._index.allocators[tier]
            counters = self._index.counters[tier]
            tiers.append(
                TierStats(
                    tier=tier.label,
                    num_blocks_capacity=alloc.num_blocks,
                    num_blocks_used=alloc.num_used,
                    num_blocks_pinned=self._index.num_pinned if tier == Tier.T0 else 0,
                    num_bytes_capacity=alloc.num_blocks * self._bytes_per_block,
                    num_bytes_used=alloc.num_used * self._bytes_per_block,
                    num_stored=counters.num_stored,
                    num_evictions=counters.num_evictions,
                    num_demotions=counters.num_demotions,
                    num_promotions=counters.num_promotions,
                )
            )
        admission = self._admission
        return CacheStats(
            tenant=tenant,
            totals=totals,
            tiers=tuple(tiers),
            thrashing=admission.thrash.thrashing,
            num_thrash_episodes=admission.thrash.num_episodes,
            eviction_ranking=admission.ranking.label,
            strictness=admission.ranking.current,
            num_ranking_switches=admission.ranking.num_switches,
            num_ghost_hit_blocks=admission.ranking.num_ghost_hit_blocks,
            store_queue_len=store_queue_len,
            num_indexed_blocks=len(self._index),
            num_memo_hits=self._memo.num_hits if self._memo else 0,
            num_memo_misses=self._memo.num_misses if self._memo else 0,
        )

    def _tenant_names(self) -> list[str]:
        return sorted(self._tenants)


def _segments(plan: StorePlan, start: int) -> list[tuple[CacheKey, int, int]]:
    """The plan's blocks from `start` on, split by namespace: the shared platform prefix (stored
    under the platform tenant) first, then the tenant's own blocks."""
    segments = []
    if start < plan.platform_blocks:
        segments.append((platform_key(plan.key), start, plan.platform_blocks))
    segments.append((plan.key, max(start, plan.platform_blocks), len(plan.hashes)))
    return segments
