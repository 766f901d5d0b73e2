"""Configuration records of the cache: pool sizes, admission knobs, and the KV layout."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_runtime.cache._keys import BLOCK_SIZE
from kvfleet_runtime.cache._reuse import REUSE_RANKING

__all__ = ["DTYPE_BYTES", "CacheTuning", "KVLayout"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(slots=True, frozen=True)
class KVLayout:
    """Shape of the KV one model produces. Pools store it canonically, TP-agnostic:
    K and V each `[num_layers, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim]`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers and heads (70B GQA-8 FP16: 327,680 B)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def bytes_per_block(self) -> int:
        return BLOCK_SIZE * self.bytes_per_token


@dataclass(slots=True, frozen=True)
class CacheTuning:
    """Sizes and knobs. Nothing here declares a per-prefix policy: that is inferred (R4)."""

    num_t0_blocks: int
    """Device pool (T0) capacity in blocks."""
    num_t1_blocks: int = 0
    """Host pool (T1) capacity in blocks; 0 disables the tier."""
    admit_min_sightings: int = 1
    """A block is stored from this sighting on; one more while thrashing under a frequency
    ranking. In a conversation every turn's prefix is re-sent by the next turn, often exactly
    once: waiting for a second sighting threw that reuse away (issue 16: 13.3% vs LRU's 17.5% of
    the Mooncake quick run's tokens at 30% capacity)."""
    hot_min_sightings: int = 3
    """From this sighting a small prefix is pinned in T0 (an agent loop earns it by step 3)."""
    pin_max_bytes: int = 2048 * 320 * 1024
    """"Small": a prefix up to this many bytes may be pinned (default ~2k tokens of a 70B model)."""
    pin_max_fraction: float = 0.5
    """At most this share of T0 is pinned, so hot prefixes cannot starve everything else."""
    store_queue_max_entries: int = 64
    """Pending writes held at once; a full queue drops its least valuable entry."""
    sketch_width: int = 1 << 22
    """Counters per sketch row (16 MiB at depth 4). It must be wide against the distinct blocks
    seen between agings, not against the cache: on the Mooncake trace (1.3M distinct blocks) a
    1M-wide sketch over-counts one-shot blocks into the cache and falls below plain LRU at 10%
    capacity (18.9% vs 25.9% of tokens); 4M-wide it does not (26.7%)."""
    sketch_depth: int = 4
    eviction_rankings: tuple[int | str | None, ...] = (1, 2, 3, 6, None)
    """Candidate eviction rankings: sighting caps (1: plain recency, as vLLM; None: the raw
    count) and `"reuse"` (`REUSE_RANKING`), the reuse-time prediction of `_reuse.py`: recency
    credited with the log of the sightings, in units of the cache's own victims' age; not among
    the defaults until its whole-trace figures are in (docs/cache.md). The cache follows the one
    whose ghost would have hit the most tokens lately (`AdaptiveRanking`), starting with the
    first. One entry fixes the ranking. Why several: a count capped at 3 kept stale documents
    less than the raw count at 3-10% of the Mooncake trace, the raw count hits 2.7x LRU at 1% of
    the system-prompt workload, and recency alone wins where space is plenty (docs/cache.md)."""
    ranking_decay: float = 0.995
    """Per store, the weight of what the ghosts hit so far (a half-life of ~140 stores)."""
    ranking_margin: float = 0.02
    """Another ranking must lead the current one's score by this share to take over."""
    ghost_max_blocks: int = 65_536
    """Blocks one ghost holds at most: a larger cache samples 1 block hash in 2^k (~145 B per
    ghost entry beside its hash, measured; 5 ghosts cost ~50 MB at most, whatever the
    capacity)."""
    store_max_fraction: float = 0.1
    """Under a ranking that counts reuse, one store writes at most `max(store_min_blocks,
    store_max_fraction x (T0 + T1 blocks), free blocks)` new blocks beyond what is already
    cached; the prefix's next blocks come with its next sighting (under plain recency a store is
    not cut: the Mooncake quick run at 1% hit 0.95% cut, 1.03% uncut, vLLM 1.02%). On the
    Mooncake trace a single prompt can be 90% of a 1% cache (11,961 of 13,321 blocks) and flush
    every counted prefix: capped, the previous policy hit 4.24% there instead of 3.85%
    (docs/cache.md)."""
    store_min_blocks: int = 1024
    """Floor of that cap (16k tokens): a small cache stores whole ordinary prompts."""
    thrash_ratio: float = 0.9
    """Thrashing: blocks dropped / blocks offered above this, sustained."""
    thrash_window_s: float = 10.0
    thrash_sustain_s: float = 30.0
    thrash_min_blocks: int = 64
    """A window with fewer offered blocks than this says nothing about thrash."""
    hash_memo_entries: int = 32_768
    """Chain steps of looked-up prefixes remembered so that a hot prefix is not hashed again at
    every request (about 200 B each, 6.5 MB at the default, 512k tokens of prefixes; 0: no
    memo). Hashing is ~85% of a lookup's cost; a memo hit returns exactly the digest hashing
    would (`ChainMemo`)."""
    platform_prefixes: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    """Explicit allow-list of platform-owned token prefixes (whole blocks), the only KV shared
    across tenants."""

    def __post_init__(self) -> None:
        if self.num_t0_blocks < 0 or self.num_t1_blocks < 0:
            raise ValueError(
                f"pool sizes must be >= 0, got num_t0_blocks={self.num_t0_blocks} "
                f"num_t1_blocks={self.num_t1_blocks}"
            )
        if self.num_t0_blocks + self.num_t1_blocks == 0:
            raise ValueError("at least one tier needs blocks, got 0 and 0")
        if not 1 <= self.admit_min_sightings <= self.hot_min_sightings:
            raise ValueError(
                f"need 1 <= admit_min_sightings <= hot_min_sightings, got "
                f"{self.admit_min_sightings} and {self.hot_min_sightings}"
            )
        if not 0.0 <= self.pin_max_fraction <= 1.0:
            raise ValueError(f"pin_max_fraction must be in [0, 1], got {self.pin_max_fraction}")
        if not self.eviction_rankings or any(
            cap is not None
            and cap != REUSE_RANKING
            and not (isinstance(cap, int) and 1 <= cap <= 255)
            for cap in self.eviction_rankings
        ):
            raise ValueError(
                f"eviction_rankings must be a non-empty tuple of caps in [1, 255], None or "
                f"{REUSE_RANKING!r}, got "
                f"{self.eviction_rankings!r}"
            )
        if not 0.0 < self.ranking_decay < 1.0 or self.ranking_margin < 0.0:
            raise ValueError(
                f"need 0 < ranking_decay < 1 and ranking_margin >= 0, got "
                f"{self.ranking_decay} and {self.ranking_margin}"
            )
        if self.ghost_max_blocks < 1:
            raise ValueError(f"ghost_max_blocks must be >= 1, got {self.ghost_max_blocks}")
        if not 0.0 < self.store_max_fraction <= 1.0:
            raise ValueError(f"store_max_fraction must be in (0, 1], got {self.store_max_fraction}")
        if self.store_min_blocks < 1:
            raise ValueError(f"store_min_blocks must be >= 1, got {self.store_min_blocks}")
        if self.hash_memo_entries != 0 and self.hash_memo_entries < 2:
            raise ValueError(f"hash_memo_entries must be 0 or >= 2, got {self.hash_memo_entries}")
        if self.store_queue_max_entries <= 0:
            raise ValueError(
                f"store_queue_max_entries must be > 0, got {self.store_queue_max_entries}"
            )
        if self.thrash_window_s <= 0 or self.thrash_sustain_s < self.thrash_window_s:
            raise ValueError(
                f"need 0 < thrash_window_s <= thrash_sustain_s, got "
                f"{self.thrash_window_s} and {self.thrash_sustain_s}"
            )
        for prefix in self.platform_prefixes:
            if not prefix or len(prefix) % BLOCK_SIZE:
                raise ValueError(
                    f"a platform prefix must be a non-empty whole number of "
                    f"{BLOCK_SIZE}-token blocks, got {len(prefix)} tokens"
                )
