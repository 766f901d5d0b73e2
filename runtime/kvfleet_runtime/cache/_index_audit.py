"""The block index's invariant audit (`BlockIndex.check_invariants`): an O(n) walk over the
index's public surface that the tests and the property-based state machine run after every step.
Apart from the index because nothing on the request path runs it. Pure and torch-free."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from kvfleet_runtime.cache._allocator import Slots
from kvfleet_runtime.cache._block_node import BlockNode
from kvfleet_runtime.cache._keys import BlockHash
from kvfleet_runtime.cache._moves import Tier
from kvfleet_runtime.cache._tier_slots import GONE

__all__ = ["AuditedIndex", "check_invariants"]


class AuditedIndex(Protocol):
    """What the audit reads of a `BlockIndex` (which calls it, so it cannot import the class)."""

    @property
    def allocators(self) -> tuple[Slots, Slots]: ...
    @property
    def num_pinned(self) -> int: ...
    def nodes(self) -> Iterator[BlockNode]: ...
    def get(self, block_hash: BlockHash) -> BlockNode | None: ...


def check_invariants(index: AuditedIndex, held: Iterable[BlockNode] = ()) -> None:
    """O(n) audit used by tests: accounting, tree shape, tier monotonicity."""
    owners: dict[tuple[int, int], BlockNode] = {}
    children: dict[int, int] = {}
    t0_children: dict[int, int] = {}
    live = list(index.nodes())
    detached = [n for n in held if not n.namespace.valid and n.tier != GONE]
    for node in live + detached:
        assert node.tier != GONE, "indexed block without a slot"
        slot = (node.tier, node.block_id)
        other = owners.setdefault(slot, node)
        assert other is node, f"slot {slot} held by two blocks"
        assert not index.allocators[node.tier].is_free(node.block_id), f"slot {slot} is free"
    for node in live:
        parent = node.parent
        if parent is not None:
            assert index.get(parent.block_hash) is parent, "orphaned block"
            assert parent.tier <= node.tier, "T0 block below a T1 block"
            children[id(parent)] = children.get(id(parent), 0) + 1
            if node.tier == Tier.T0:
                t0_children[id(parent)] = t0_children.get(id(parent), 0) + 1
    for node in live:
        assert node.num_children == children.get(id(node), 0), "child count drift"
        assert node.num_t0_children == t0_children.get(id(node), 0), "T0 child count drift"
    for tier in (Tier.T0, Tier.T1):
        used = sum(1 for t, _ in owners if t == tier)
        assert used == index.allocators[tier].num_used, f"{tier.label}: leaked slots"
    assert index.num_pinned == sum(1 for n in live + detached if n.pinned), "pin count drift"
