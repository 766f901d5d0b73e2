"""Slot accounting per tier: which slots of T0 and T1 the index holds, its pins, its counters,
and whether a tier hands out slots at all (the fleet config's switches). Owned by `BlockIndex`
(`_block_index.py`, its `slots`): the radix index decides which block goes where; this object
keeps the slots, pins and counters in step when a block's slot is freed or it changes tier.
Pure and torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_runtime.cache._allocator import BlockAllocator, Slots
from kvfleet_runtime.cache._block_node import BlockNode
from kvfleet_runtime.cache._moves import Move, Plan, Tier

__all__ = ["GONE", "TierCounters", "TierSlots"]


GONE = -1
"""`BlockNode.tier` of a block whose slot has been freed."""


@dataclass(slots=True)
class TierCounters:
    num_evictions: int = 0
    """Blocks dropped from the cache out of this tier."""
    num_demotions: int = 0
    num_promotions: int = 0
    num_stored: int = 0


class TierSlots:
    """The slots of both tiers, the pins and the per-tier counters of one index."""

    def __init__(
        self, num_blocks: tuple[int, int], *, pin_limit: int = 0, t0_slots: Slots | None = None
    ) -> None:
        """`t0_slots`: T0's slots when T0 is the engine's KV (`CachedSlots`)."""
        self.allocators: tuple[Slots, Slots] = (
            t0_slots if t0_slots is not None else BlockAllocator(num_blocks[0]),
            BlockAllocator(num_blocks[1]),
        )
        self.counters = (TierCounters(), TierCounters())
        self.num_pinned = 0
        self.pin_limit = pin_limit
        """Pinned blocks T0 may hold at most."""
        self.t1_enabled = True
        """False (the fleet config's `tiers.t1_host` off): no slot of T1 is handed out."""
        self.t0_enabled = True
        """False (the fleet config's `tiers.t0_device` off): no slot of T0 is handed to the
        cache (no store in place, no promotion), so nothing is filed in T0."""

    def free_slot(self, node: BlockNode) -> None:
        tier = node.tier
        self.allocators[tier].free([node.block_id])
        if node.pinned:
            self.num_pinned -= 1
            node.pinned = False
        node.tier = GONE

    def move_to_t0(self, node: BlockNode, slot: int) -> None:
        """File `node` in T0 slot `slot` (its data is, or is planned to be, copied there): its T1
        slot is freed, the parent counts one T0 child more. `move_to_t1`'s reverse."""
        self.allocators[Tier.T1].free([node.block_id])
        node.tier, node.block_id = Tier.T0, slot
        if node.parent is not None:
            node.parent.num_t0_children += 1
        self.counters[Tier.T1].num_promotions += 1

    def move_to_t1(self, node: BlockNode, slot: int, plan: Plan) -> None:
        """Move `node` from its T0 block to T1 slot `slot` (the copy is `plan`'s move): the T0
        block is freed, a pin is dropped, the parent counts one T0 child less."""
        plan.moves.append(Move(Tier.T0, node.block_id, Tier.T1, slot))
        self.allocators[Tier.T0].free([node.block_id])
        if node.pinned:
            self.num_pinned -= 1
            node.pinned = False
        node.tier, node.block_id = Tier.T1, slot
        self.counters[Tier.T0].num_demotions += 1
        if node.parent is not None:
            node.parent.num_t0_children -= 1
