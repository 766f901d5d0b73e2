"""What an index operation plans and the pools carry out: copies between tiers (`Move`), and the
blocks it dropped (`Plan`). Below both the index (which plans) and the pools (which copy), so
neither imports the other; pure and torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the index imports this module: the node type is only needed for checking
    from kvfleet_runtime.cache._block_node import BlockNode

__all__ = ["Move", "Plan", "Tier"]


class Tier(enum.IntEnum):
    T0 = 0
    """Device memory (HBM; CPU tensors when there is no GPU)."""
    T1 = 1
    """Host DRAM (pinned when CUDA is present)."""

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True, frozen=True)
class Move:
    """Copy block `src_id` of `src_tier` into `dst_id` of `dst_tier` (executed in list order)."""

    src_tier: Tier
    src_id: int
    dst_tier: Tier
    dst_id: int


@dataclass(slots=True)
class Plan:
    moves: list[Move] = field(default_factory=list)
    dropped: list[BlockNode] = field(default_factory=list)
    dropped_from: list[int] = field(default_factory=list)
    """The tier each `dropped` block left (its slot still holds its data until `moves` run)."""
    held: list[BlockNode] = field(default_factory=list)
    """Blocks demoted T0 -> T1 by this plan, each holding one extra ref until the plan is
    complete (`BlockIndex.release_held`): a later eviction of the same plan must not drop one
    from T1 before its copy has run. Its T1 slot would be read for the eviction sink (T3) before
    the data is there, and handed to a second block (two moves into one slot, and two blocks
    holding it once `order_demotions` renumbers them)."""
