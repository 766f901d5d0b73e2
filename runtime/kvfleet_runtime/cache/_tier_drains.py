"""Blocks leaving the index wholesale: a tier turned off by the fleet config (`disable_t1`,
`disable_t0`: T0 blocks demoted to T1 where it takes them) and a weights version invalidated
(`invalidate`). A referenced block that leaves keeps its slot and data until its request
releases it, in a detached namespace. Owned by `BlockIndex` (`_block_index.py`), whose radix
index and eviction these use through `DrainedIndex`; apart from it because nothing on the
request path runs them.
Pure and torch-free."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from kvfleet_runtime.cache._block_node import BlockNode, Namespace
from kvfleet_runtime.cache._moves import Plan, Tier
from kvfleet_runtime.cache._tier_slots import TierSlots

if TYPE_CHECKING:
    from kvfleet_runtime.cache._eviction import EvictionPolicy
    from kvfleet_runtime.cache._keys import BlockHash, CacheKey

__all__ = ["DrainedIndex", "TierDrains"]


class DrainedIndex(Protocol):
    """What the drains use of their `BlockIndex`: its slots, its policy, its nodes and the
    operations that keep the eviction queues and holds in step."""

    @property
    def slots(self) -> TierSlots: ...
    @property
    def policy(self) -> EvictionPolicy: ...
    def nodes(self) -> Iterator[BlockNode]: ...
    def get(self, block_hash: BlockHash) -> BlockNode | None: ...
    def keyed_namespaces(self) -> dict[CacheKey, Namespace]: ...
    def unindex(self, node: BlockNode) -> None: ...
    def push(self, node: BlockNode) -> None: ...
    def reserve(
        self, tier: int, n: int, candidate_weights: Sequence[int] | None, plan: Plan
    ) -> list[int]: ...
    def order_demotions(self, demoted: list[BlockNode], plan: Plan) -> None: ...
    def release_held(self, nodes: list[BlockNode]) -> None: ...


class TierDrains:
    """Turning a tier off and invalidating a weights version, for the `BlockIndex` that owns
    it."""

    __slots__ = ("index", "slots")

    def __init__(self, index: DrainedIndex) -> None:
        self.index = index
        self.slots = index.slots

    def disable_t1(self) -> list[BlockNode]:
        """Turn T1 off: no more T1 slots, and every T1 block leaves the index now (unreachable).
        Unreferenced blocks free their slots now; a block an in-flight hit references keeps its
        slot (and its data) until that hit's release, as an invalidated block does: it moves to
        a detached namespace. Returns the blocks removed from the index."""
        self.slots.t1_enabled = False
        gone = [n for n in self.index.nodes() if n.tier == Tier.T1]
        detached: dict[int, Namespace] = {}
        for node in gone:
            self.index.unindex(node)
            self.slots.counters[Tier.T1].num_evictions += 1
            parent = node.parent
            if parent is not None and parent.tier != Tier.T1:  # a T0 parent stays indexed
                parent.num_children -= 1
                self.index.push(parent)
        for node in gone:
            self._free_or_detach(node, detached)
        return gone

    def disable_t0(self) -> tuple[Plan, list[BlockNode]]:
        """Turn T0 off: no more T0 slots for the cache, and every T0 block leaves T0 now.

        Root first, a T0 block is demoted to T1 by copy when T1 is on and takes it (it must win
        T1's duel as a candidate of its own weight, as an eviction's demotion does); otherwise it
        leaves the index together with everything below it (its descendants are unreachable
        without it). Referenced blocks are treated alike: a demoted one's in-flight hit reads it
        from T1 (the sequence keeps its own ref on the T0 slot); a removed one keeps its slot and
        data until that hit's release, in a detached namespace (as in `disable_t1`), and
        unreferenced removed blocks free their slots now.

        Returns the plan (the demotion copies, and the T1 blocks evicted to make room for them:
        carry out its moves before anyone may take a T0 slot) and the blocks removed."""
        self.slots.t0_enabled = False
        plan = Plan()
        children: dict[int, list[BlockNode]] = {}
        for node in self.index.nodes():
            if node.parent is not None:
                children.setdefault(id(node.parent), []).append(node)
        depth: dict[int, int] = {}

        def depth_of(node: BlockNode) -> int:
            above: list[BlockNode] = []
            top: BlockNode | None = node
            while top is not None and id(top) not in depth:
                above.append(top)
                top = top.parent
            d = -1 if top is None else depth[id(top)]
            for n in reversed(above):  # chains run to thousands of blocks: no recursion
                d += 1
                depth[id(n)] = d
            return depth[id(node)]

        t0 = sorted((n for n in self.index.nodes() if n.tier == Tier.T0), key=depth_of)
        demoted: list[BlockNode] = []
        gone: list[BlockNode] = []
        for node in t0:
            if self.index.get(node.block_hash) is not node:
                continue  # it left with an ancestor
            if self._demote_for_drain(node, plan):
                demoted.append(node)
            else:
                self._unindex_subtree(node, children, gone)
        self.index.order_demotions(demoted, plan)
        self.index.release_held(plan.held)
        return plan, gone

    def _demote_for_drain(self, node: BlockNode, plan: Plan) -> bool:
        """Demote one T0 block to T1 for `disable_t0`, if T1 takes it (held until the drain is
        planned, `Plan.held`)."""
        if not self.slots.t1_enabled or not self.slots.allocators[Tier.T1].num_blocks:
            return False
        weights = self.index.policy.candidate_weights([node.block_hash])
        node.ref_count += 1
        got = self.index.reserve(Tier.T1, 1, weights, plan)
        if not got:
            node.ref_count -= 1
            return False
        self.slots.move_to_t1(node, got[0], plan)
        plan.held.append(node)  # keeps the ref taken above
        return True

    def _unindex_subtree(
        self, top: BlockNode, children: dict[int, list[BlockNode]], gone: list[BlockNode]
    ) -> None:
        """Remove `top` and every indexed block below it from the index (unreachable now);
        unreferenced ones free their slots, referenced ones move to a detached namespace."""
        parent = top.parent
        if parent is not None:
            parent.num_children -= 1
            if top.tier == Tier.T0:
                parent.num_t0_children -= 1
            self.index.push(parent)
        stack = [top]
        detached: dict[int, Namespace] = {}
        while stack:
            node = stack.pop()
            if self.index.get(node.block_hash) is not node:
                continue
            stack.extend(children.get(id(node), ()))
            self.index.unindex(node)
            self.slots.counters[node.tier].num_evictions += 1
            gone.append(node)
            self._free_or_detach(node, detached)

    def _free_or_detach(self, node: BlockNode, detached: dict[int, Namespace]) -> None:
        """A node that left the index: its slot is freed now, or, while a request still holds
        it, it moves to an invalid copy of its namespace (one per namespace, in `detached`) so
        it is never found again and its slot is freed when the last ref goes."""
        if node.ref_count == 0:
            self.slots.free_slot(node)
            return
        ns = detached.get(id(node.namespace))
        if ns is None:
            ns = detached[id(node.namespace)] = Namespace(node.namespace.key, valid=False)
        node.namespace = ns

    def invalidate(self, weights_digest: str) -> tuple[int, list[BlockNode]]:
        """Make every block of a weights version unreachable; free the unreferenced ones now and
        the referenced ones at their release. Returns (blocks unindexed, blocks freed now)."""
        namespaces = self.index.keyed_namespaces()
        stale = [ns for k, ns in namespaces.items() if k.weights_digest == weights_digest]
        if not stale:
            return 0, []
        for ns in stale:
            ns.valid = False
            del namespaces[ns.key]
        gone = [n for n in self.index.nodes() if not n.namespace.valid]
        freed: list[BlockNode] = []
        for node in gone:
            self.index.unindex(node)
            if node.ref_count == 0:
                self.slots.free_slot(node)
                freed.append(node)
        return len(gone), freed
