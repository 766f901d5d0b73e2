"""Stats records: per tenant and per tier, as plain snapshots (the Prometheus view reads these)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheStats", "TenantStats", "TierStats"]


@dataclass(slots=True)
class TenantStats:
    num_lookups: int = 0
    num_hits: int = 0
    """Lookups that matched at least one block."""
    num_lookup_tokens: int = 0
    num_matched_tokens: int = 0
    num_store_requests: int = 0
    num_blocks_offered: int = 0
    """Full blocks passed to `store` (resident or not): the denominator of the thrash ratio."""
    num_blocks_stored: int = 0
    num_admissions_refused: int = 0
    """Blocks not stored because they had not been seen often enough (one-shot)."""
    num_first_sighting_admissions: int = 0
    """Blocks admitted to a store at their first sighting (no pressure, or a recency ranking)."""
    num_store_drops: int = 0
    """Pending writes dropped from a full store queue as its least valuable entry."""
    num_evictions: int = 0
    """Blocks dropped from the cache (demotions T0 -> T1 are not evictions)."""
    num_invalidated: int = 0
    """Blocks removed by `invalidate` (their weights version was withdrawn)."""
    num_blocks: int = 0
    """Blocks resident now."""
    num_bytes: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.num_matched_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    def add(self, other: TenantStats) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(slots=True)
class TierStats:
    tier: str
    num_blocks_capacity: int
    num_blocks_used: int
    num_blocks_pinned: int
    num_bytes_capacity: int
    num_bytes_used: int
    num_stored: int
    num_evictions: int
    num_demotions: int
    num_promotions: int


@dataclass(slots=True)
class CacheStats:
    """A snapshot: `tenant` None means all tenants (platform-owned blocks included)."""

    tenant: str | None
    totals: TenantStats
    tiers: tuple[TierStats, ...]
    thrashing: bool
    num_thrash_episodes: int
    store_queue_len: int
    num_indexed_blocks: int
    eviction_ranking: str = "recency"
    """The eviction ranking the cache follows now: "recency" (LRU), "count<=N" (sightings capped
    at N, then recency) or "count" (raw sightings)."""
    strictness: int = 0
    """Position of that ranking in `CacheTuning.eviction_rankings` (0: the first, recency)."""
    num_ranking_switches: int = 0
    num_ghost_hit_blocks: int = 0
    """Blocks the followed ranking's ghost matched beyond the cache: evicted or refused blocks
    that came back."""
    num_memo_hits: int = 0
    """Chain steps the hash memo answered (`ChainMemo`); all tenants."""
    num_memo_misses: int = 0
