"""One indexed block (`BlockNode`) and the scoped key its tree hangs from (`Namespace`): the
records the block index, the moves and the eviction policy all read. A leaf: it imports
nothing of the cache but its keys."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_runtime.cache._keys import BlockHash, CacheKey

__all__ = ["BlockNode", "Namespace"]


@dataclass(slots=True, eq=False)
class Namespace:
    """One scoped cache key: the radix tree root of a (tenant, key)."""

    key: CacheKey
    valid: bool = True
    num_blocks: int = 0


@dataclass(slots=True, eq=False)
class BlockNode:
    """Metadata of one indexed block. Kept to a handful of slots: the index holds 100k+ of these
    and the budget is 256 B per block (see the bench)."""

    block_hash: BlockHash
    parent: BlockNode | None
    namespace: Namespace
    tier: int
    block_id: int
    num_children: int = 0
    num_t0_children: int = 0
    ref_count: int = 0
    last_tick: int = 0
    pinned: bool = False
    floor: int = 0
    """The block's chain-bounded sighting count at its last sighting (a floor of the sketch's
    estimate), kept for the eviction ranking: `(epoch + 1) << 8 | count`, valid while the
    sketch's reset count is `epoch` (0: none)."""
