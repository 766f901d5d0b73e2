"""The radix index over blocks and the tiered block accounting: which chain hash lives where.

Pure and torch-free. Nodes are blocks; a node's parent is the block before it in its chain, so the
index is a radix tree per (tenant, key) whose edges are 16-token blocks (chained hashes already
commit to the whole prefix, so a flat hash map finds a node and the parent link re-checks the
chain). Data movement is *planned* here and executed by the tensor pool: every operation that moves
or overwrites data returns `Move`s / block ids in the order they must be carried out.

Invariants (checked by `check_invariants`, exercised by the property tests):
- a referenced block (ref_count > 0) is never freed, moved out of, or overwritten;
- refs are path-closed: a hit references every block from the root to its deepest match;
- tiers are monotone along a chain: a T0 block never hangs below a T1 block, so a hit is a T0
  prefix followed by a T1 suffix;
- only leaves are dropped: an interior block is never evicted before its descendants;
- every slot of every tier is either free or held by exactly one block;
- a block demoted T0 -> T1 by an operation is not evicted by the same operation (its copy has
  not run yet: `Plan.held`).

The index decides what is evictable (unreferenced, valid, a leaf of its tier) and carries out
evictions, demotions and promotions; which evictable block goes first, and whether a newcomer may
take its slot, is the `EvictionPolicy`'s (`_eviction.py`), handed in by the caller: the index knows
no counts. A newcomer that the policy's victim outranks is refused ("the duel"); a demotion
T0 -> T1 must win the same duel in T1, as a candidate of its own weight.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvfleet_runtime.cache._allocator import Slots
from kvfleet_runtime.cache._block_node import BlockNode, Namespace
from kvfleet_runtime.cache._eviction import EvictionPolicy
from kvfleet_runtime.cache._index_audit import check_invariants
from kvfleet_runtime.cache._keys import BlockHash, CacheKey
from kvfleet_runtime.cache._moves import Move, Plan, Tier
from kvfleet_runtime.cache._tier_drains import TierDrains
from kvfleet_runtime.cache._tier_slots import GONE, TierCounters, TierSlots

__all__ = ["BlockIndex", "BlockNode", "Move", "Namespace", "Plan", "Tier", "TierCounters"]

_MAX_SPARE = 4096
"""Recycled nodes kept for re-use at most (~600 KB): a few evicting misses' worth."""


class BlockIndex:
    """Chain hash -> block node, plus ref counts and eviction. It owns two collaborators: its
    slots (`slots`, a `TierSlots`) and the drains (a tier turned off, a version invalidated:
    `TierDrains`, over this index's operations)."""

    def __init__(
        self,
        num_blocks: tuple[int, int],
        policy: EvictionPolicy,
        *,
        pin_limit: int = 0,
        t0_slots: Slots | None = None,
    ) -> None:
        """`t0_slots`: T0's slots when T0 is the engine's KV (`CachedSlots`); its blocks are then
        also held by sequences, and one that a sequence still holds is never a victim."""
        self.slots = TierSlots(num_blocks, pin_limit=pin_limit, t0_slots=t0_slots)
        self.allocators = self.slots.allocators
        """The slots of each tier (`TierSlots.allocators`; the same objects)."""
        self.counters = self.slots.counters
        self.policy = policy
        """Victim order and the duel (`set_policy` swaps it)."""
        self._nodes: dict[BlockHash, BlockNode] = {}
        self._namespaces: dict[CacheKey, Namespace] = {}
        self._tick = 0
        self._spare: list[BlockNode] = []
        """Dropped nodes nobody reads any more (`recycle`), which `_link` fills anew."""
        self._drains = TierDrains(self)

    # -- the slots' switches and pins (`TierSlots`) ----------------------------------------

    @property
    def t0_enabled(self) -> bool:
        return self.slots.t0_enabled

    @t0_enabled.setter
    def t0_enabled(self, enabled: bool) -> None:
        self.slots.t0_enabled = enabled

    @property
    def t1_enabled(self) -> bool:
        return self.slots.t1_enabled

    @t1_enabled.setter
    def t1_enabled(self, enabled: bool) -> None:
        self.slots.t1_enabled = enabled

    @property
    def num_pinned(self) -> int:
        return self.slots.num_pinned

    @property
    def pin_limit(self) -> int:
        return self.slots.pin_limit

    # -- tiers turned off, versions invalidated (`TierDrains`) ------------------------------

    def disable_t1(self) -> list[BlockNode]:
        """`TierDrains.disable_t1`."""
        return self._drains.disable_t1()

    def disable_t0(self) -> tuple[Plan, list[BlockNode]]:
        """`TierDrains.disable_t0`."""
        return self._drains.disable_t0()

    def invalidate(self, weights_digest: str) -> tuple[int, list[BlockNode]]:
        """`TierDrains.invalidate`."""
        return self._drains.invalidate(weights_digest)

    # -- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, block_hash: BlockHash) -> BlockNode | None:
        return self._nodes.get(block_hash)

    def nodes(self) -> Iterator[BlockNode]:
        return iter(self._nodes.values())

    def namespaces(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def keyed_namespaces(self) -> dict[CacheKey, Namespace]:
        """The live namespaces by key (the drains remove invalidated ones)."""
        return self._namespaces

    def unindex(self, node: BlockNode) -> None:
        """Take `node` out of the index (its slot is the caller's to free or keep)."""
        del self._nodes[node.block_hash]
        node.namespace.num_blocks -= 1

    def namespace(self, key: CacheKey) -> Namespace:
        ns = self._namespaces.get(key)
        if ns is None:
            ns = self._namespaces[key] = Namespace(key)
        return ns

    def match(self, hashes: Iterable[BlockHash]) -> list[BlockNode]:
        """The longest chain of indexed blocks along `hashes` (stops hashing at the first miss)."""
        nodes = self._nodes
        path: list[BlockNode] = []
        parent: BlockNode | None = None
        for h in hashes:
            node = nodes.get(h)
            # The parent check is belt and braces: a chained hash already commits to its prefix.
            if node is None or node.parent is not parent:
                break
            path.append(node)
            parent = node
        return path

    # -- refs ------------------------------------------------------------------------------

    def acquire(self, path: list[BlockNode]) -> None:
        self._tick += 1
        tick = self._tick
        for node in path:
            node.ref_count += 1
            node.last_tick = tick

    def release(self, path: list[BlockNode]) -> list[BlockNode]:
        """Drop one ref on each block; returns blocks freed because they were invalidated."""
        freed: list[BlockNode] = []
        for node in reversed(path):
            assert node.ref_count > 0, "release of a block that holds no ref"
            node.ref_count -= 1
            if node.ref_count == 0:
                if not node.namespace.valid:
                    if node.tier != GONE:
                        self.slots.free_slot(node)
                        freed.append(node)
                elif (node.num_t0_children if node.tier == Tier.T0 else node.num_children) == 0:
                    self.push(node)  # interior blocks are not evictable: nothing to queue
        return freed

    def touch(self, path: list[BlockNode], floors: Sequence[int] = ()) -> None:
        """The path was used now. `floors`: the path's `BlockNode.floor`s at this sighting, in
        path order (empty: not a sighting, e.g. a lookup)."""
        self._tick += 1
        tick = self._tick
        if floors:
            for node, floor in zip(path, floors, strict=True):
                node.floor = floor  # before the push: the ranking reads it
                node.last_tick = tick
                if not node.ref_count:
                    self.push(node)
            return
        for node in path:
            node.last_tick = tick
            if not node.ref_count:  # a referenced block is not evictable: nothing to queue
                self.push(node)

    # -- eviction --------------------------------------------------------------------------

    def _evictable(self, node: BlockNode, tier: int) -> bool:
        if node.tier != tier or node.ref_count or not node.namespace.valid:
            return False
        return node.num_t0_children == 0 if tier == Tier.T0 else node.num_children == 0

    def _evictable_in(self, tier: int) -> Callable[[BlockNode], bool]:
        return self._evictable_t0 if tier == Tier.T0 else self._evictable_t1

    # `_evictable` for one tier, spelled out: these run once per queued or popped victim.
    @staticmethod
    def _evictable_t0(node: BlockNode) -> bool:
        return (node.tier == Tier.T0 and not node.ref_count and node.namespace.valid
                and node.num_t0_children == 0)

    @staticmethod
    def _evictable_t1(node: BlockNode) -> bool:
        return (node.tier == Tier.T1 and not node.ref_count and node.namespace.valid
                and node.num_children == 0)

    def push(self, node: BlockNode) -> None:
        tier = node.tier
        if tier == Tier.T0:
            if self._evictable_t0(node):
                self.policy.push(node, self._evictable_t0)
        elif tier == Tier.T1 and self._evictable_t1(node):
            self.policy.push(node, self._evictable_t1)

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Rank eviction by another policy, handed every evictable block now (a lazy queue only
        re-ranks entries whose weight grew, so re-using the old queues under a lower cap would
        leave old heavy entries behind the new light ones)."""
        for tier in (Tier.T0, Tier.T1):
            policy.fill(tier, (n for n in self._nodes.values() if self._evictable(n, tier)))
        self.policy = policy

    def _pop_victim(self, tier: int) -> BlockNode | None:
        return self.policy.pop(tier, self._evictable_in(tier))

    def _drop(self, node: BlockNode, plan: Plan) -> None:
        """Remove a leaf from the index and free its slot."""
        assert node.num_children == 0 and node.ref_count == 0
        tier = node.tier
        self.counters[tier].num_evictions += 1
        self.slots.free_slot(node)
        del self._nodes[node.block_hash]
        node.namespace.num_blocks -= 1
        parent = node.parent
        if parent is not None:
            parent.num_children -= 1
            if tier == Tier.T0:
                parent.num_t0_children -= 1
            self.push(parent)
        plan.dropped.append(node)
        plan.dropped_from.append(tier)

    def reserve(
        self, tier: int, n: int, candidate_weights: Sequence[int] | None, plan: Plan
    ) -> list[int]:
        """Up to `n` free slots of `tier`, evicting victims that lose the policy's duel.

        Slot i goes to a candidate of weight `candidate_weights[i]` (None: no duel, e.g. to
        demote an interior block that cannot be dropped). Returns fewer than `n` ids when the tier
        is full of referenced blocks or of blocks that outrank the candidate: not enough room is
        not an error."""
        alloc = self.allocators[tier]
        if not (self.slots.t1_enabled if tier == Tier.T1 else self.slots.t0_enabled):
            return []
        ids = alloc.allocate(min(n, alloc.num_free)) or []
        skipped: list[BlockNode] = []
        while len(ids) < n:
            victim = self._pop_victim(tier)
            if victim is None:
                break
            if self.allocators[tier].in_use(victim.block_id):
                skipped.append(victim)  # a sequence still reads it: evicting frees no room
                continue
            if candidate_weights is not None and self.policy.outranks(
                victim, candidate_weights[len(ids)]
            ):
                skipped.append(victim)
                break
            if not self._evict(victim, plan):
                skipped.append(victim)
                continue
            got = alloc.allocate(1)
            assert got is not None
            ids.extend(got)
        for node in skipped:
            self.push(node)
        return ids

    def _evict(self, victim: BlockNode, plan: Plan) -> bool:
        """Free the victim's slot: demote T0 -> T1 if T1 admits it, else drop it if it is a leaf.
        False when neither is possible (an interior T0 block T1 cannot take)."""
        if victim.tier == Tier.T0 and self.allocators[Tier.T1].num_blocks:
            interior = victim.num_children > 0
            weights = None if interior else self.policy.candidate_weights([victim.block_hash])
            victim.ref_count += 1  # its own demotion must not pick it as a T1 victim
            got = self.reserve(Tier.T1, 1, weights, plan)
            victim.ref_count -= 1
            if got:
                self.slots.move_to_t1(victim, got[0], plan)
                if victim.parent is not None:
                    self.push(victim.parent)
                victim.ref_count += 1  # until the plan is complete (`Plan.held`)
                plan.held.append(victim)
                return True
        if victim.num_children:
            return False
        self._drop(victim, plan)
        return True

    # -- writes ----------------------------------------------------------------------------

    def insert(
        self,
        namespace: Namespace,
        parent: BlockNode | None,
        hashes: list[BlockHash],
        *,
        tier: Tier,
        pinned: bool,
        held: list[BlockNode] | None = None,
        floors: Sequence[int] = (),
    ) -> tuple[list[BlockNode], Plan]:
        """Index new blocks below `parent` (the chain's resident prefix), as many as fit.

        The returned nodes are referenced (the caller writes their data, then releases them), so
        the blocks cannot be evicted before their data is there. `held`: a caller that plans
        more before it carries out the moves (a write in segments) collects the demoted blocks
        there and releases them with `release_held` once its last step is planned; without it,
        they are released when this insert is planned. `floors`: the new nodes'
        `BlockNode.floor`s, in chain order (empty: none known)."""
        plan = Plan()
        if parent is not None:
            tier = max(tier, Tier(parent.tier))  # monotone tiers along a chain
            parent.ref_count += 1
        if tier != Tier.T0 or self.slots.num_pinned + len(hashes) > self.slots.pin_limit:
            pinned = False
        ids = self.reserve(tier, len(hashes), self.policy.candidate_weights(hashes), plan)
        if parent is not None:
            parent.ref_count -= 1
            self.push(parent)
        nodes = self._link(namespace, parent, hashes[: len(ids)], ids, tier, pinned, floors)
        if held is None:
            self.release_held(plan.held)
        else:
            held.extend(plan.held)
        plan.held = []
        return nodes, plan

    def release_held(self, nodes: list[BlockNode]) -> None:
        """End the holds of demoted blocks (`Plan.held`): they are evictable in T1 again."""
        for node in nodes:
            node.ref_count -= 1
        for node in nodes:
            self.push(node)
        nodes.clear()

    def promote(self, path: list[BlockNode]) -> Plan:
        """Move the T1 suffix of a referenced path into T0, as far as T0 has room."""
        plan = Plan()
        # Not detached blocks (T1 turned off under an in-flight hit): they leave at release.
        t1_nodes = [n for n in path if n.tier == Tier.T1 and n.namespace.valid]
        if not t1_nodes or not self.allocators[Tier.T0].num_blocks or not self.slots.t0_enabled:
            return plan
        weights = self.policy.candidate_weights([n.block_hash for n in t1_nodes])
        ids = self.reserve(Tier.T0, len(t1_nodes), weights, plan)
        for node, block_id in zip(t1_nodes, ids, strict=False):
            plan.moves.append(Move(Tier.T1, node.block_id, Tier.T0, block_id))
            self.slots.move_to_t0(node, block_id)
        self.release_held(plan.held)
        return plan

    # -- checks ----------------------------------------------------------------------------

    def check_invariants(self, held: Iterable[BlockNode] = ()) -> None:
        """The O(n) audit the tests run (`_index_audit.py`); `held`: detached blocks still
        referenced by in-flight requests."""
        check_invariants(self, held)

    # -- T0 as the engine's KV -------------------------------------------------------------

    def adopt(
        self,
        namespace: Namespace,
        parent: BlockNode | None,
        hashes: list[BlockHash],
        block_ids: Sequence[int],
        *,
        pinned: bool,
        floors: Sequence[int] = (),
        referenced: bool = True,
    ) -> list[BlockNode]:
        """Index blocks already computed in T0 slots `block_ids` (the engine's own blocks, held by
        the sequence): bookkeeping, no data moves. The parent must be in T0 (monotone tiers).
        The returned nodes are referenced, as from `insert`; without `referenced`, created
        unreferenced (the caller has nothing to write and pushes the chain's leaf, `push_leaf`,
        once it is done: what a release of the referenced nodes would have queued)."""
        assert parent is None or parent.tier == Tier.T0, "adopt below a T1 block"
        slots = self.allocators[Tier.T0]
        adopt = getattr(slots, "adopt", None)
        assert adopt is not None, "T0 is not the engine's KV"
        adopt(block_ids)
        if self.slots.num_pinned + len(hashes) > self.slots.pin_limit:
            pinned = False
        assert len(hashes) == len(block_ids)
        return self._link(
            namespace, parent, hashes, block_ids, Tier.T0, pinned, floors, 1 if referenced else 0
        )

    def recycle(self, dropped: list[BlockNode]) -> None:
        """Dropped nodes (`Plan.dropped`) that nothing will read again (their withdrawal events
        are built, no eviction sink holds them), for `_link` to re-use, up to `_MAX_SPARE`. A
        stale victim-queue entry of one stays stale: it names the node's old tick, and a re-used
        node gets a newer one."""
        spare = self._spare
        room = _MAX_SPARE - len(spare)
        if room > 0:
            spare.extend(dropped[:room])

    def push_leaf(self, node: BlockNode) -> None:
        """Queue an unreferenced new leaf (`adopt(referenced=False)`) for eviction: the one
        push `release` of the chain it ends would make (interior blocks are not evictable)."""
        self.push(node)

    def _link(
        self,
        namespace: Namespace,
        parent: BlockNode | None,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        tier: Tier,
        pinned: bool,
        floors: Sequence[int] = (),
        refs: int = 1,
    ) -> list[BlockNode]:
        """Index `hashes[i]` in slot `block_ids[i]` of `tier`, a chain below `parent`, every node
        with `refs` refs (`insert` and `adopt`: the one loop that creates nodes), node i created
        with floor `floors[i]` (0 beyond them: none known; set here rather than in a second pass
        over the new nodes, which cost an evicting miss ~10 us)."""
        nodes = self._nodes
        num_before = len(nodes)
        self._tick += 1
        tick = self._tick
        t0 = tier == Tier.T0
        new: list[BlockNode] = []
        # Every new node but the last has one child, the next (of the same tier): created with
        # its counts, the last one's zeroed after the loop. Positional BlockNode fields:
        # block_hash, parent, namespace, tier, block_id, num_children, num_t0_children,
        # ref_count, last_tick, pinned, floor.
        t0_child = 1 if t0 else 0
        above = parent
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        floor_of = itertools.chain(floors, itertools.repeat(0))
        spare = self._spare
        num_reused = min(len(spare), len(hashes))
        if num_reused:
            # Recycled nodes first, every field set as the constructor would (an evicting miss
            # drops a chain's worth of nodes and creates as many: allocating and freeing them
            # cost ~4x setting the fields). `reused` leads the zip, so it stops before taking
            # a floor it will not use.
            reused = spare[-num_reused:]
            del spare[-num_reused:]
            for node, h, block_id, floor in zip(
                reused, hashes, block_ids, floor_of, strict=False
            ):
                node.block_hash = h
                node.parent = above
                node.namespace = namespace
                node.tier = tier
                node.block_id = block_id
                node.num_children = 1
                node.num_t0_children = t0_child
                node.ref_count = refs
                node.last_tick = tick
                node.pinned = pinned
                node.floor = floor
                nodes[h] = node
                above = node
            new = reused
            hashes, block_ids = hashes[num_reused:], block_ids[num_reused:]
        for h, block_id, floor in zip(hashes, block_ids, floor_of, strict=False):
            node = BlockNode(
                h, above, namespace, tier, block_id, 1, t0_child, refs, tick, pinned, floor
            )
            nodes[h] = node
            new.append(node)
            above = node
        if new:
            new[-1].num_children = new[-1].num_t0_children = 0
            if parent is not None:
                parent.num_children += 1
                parent.num_t0_children += t0_child
        assert len(nodes) == num_before + len(new), "a block that is already indexed"
        namespace.num_blocks += len(new)
        if pinned:
            self.slots.num_pinned += len(new)
        self.counters[tier].num_stored += len(new)
        return new

    def promote_in_place(self, nodes: Sequence[BlockNode], block_ids: Sequence[int]) -> None:
        """T1 blocks whose data was just copied into user-held T0 slots `block_ids` move to T0
        there (their T1 slots are freed). `nodes` are referenced and follow the path's T0 part."""
        slots = self.allocators[Tier.T0]
        adopt = getattr(slots, "adopt", None)
        assert adopt is not None, "T0 is not the engine's KV"
        adopt(block_ids)
        for node, block_id in zip(nodes, block_ids, strict=True):
            assert node.tier == Tier.T1 and node.ref_count > 0
            assert node.parent is None or node.parent.tier == Tier.T0
            self.slots.move_to_t0(node, block_id)

    def reclaim(self, num_free: int) -> Plan:
        """Evict T0 victims, in the policy's order, until T0 has `num_free` free slots (in-flight
        work needs them) or nothing more can go: demoted to T1 when T1 admits them, else dropped.
        Victims a sequence still holds are passed over (evicting them would free nothing)."""
        slots = self.allocators[Tier.T0]
        need = num_free - slots.num_free
        if need <= 0:
            return Plan()
        if self.allocators[Tier.T1].num_blocks and self.slots.t1_enabled:
            return self._reclaim_demoting(num_free)
        return self._reclaim_dropping(need)

    def _reclaim_dropping(self, need: int) -> Plan:
        """`reclaim` without a T1 to demote to: every victim is dropped. The same victims, in the
        same order, as popping one and `_drop`ping it at a time, in one loop: a chain goes leaf
        first and each drop makes its parent the likely next victim, so the parent's push and the
        next pop are one `push_pop` (no heap traffic when the parent is the smallest entry); the
        freed slots go back in one call."""
        plan = Plan()
        policy = self.policy
        evictable = self._evictable_t0
        t0 = Tier.T0
        pop = policy.pop
        push_pop_in = getattr(policy, "push_pop_in", None)
        push_pop = push_pop_in(t0) if push_pop_in is not None else None
        slots = self.allocators[t0]
        in_use = slots.in_use
        nodes = self._nodes
        dropped = plan.dropped
        freed: list[int] = []
        skipped: list[BlockNode] = []
        num_unpinned = 0
        victim = pop(t0, evictable)
        while victim is not None:
            if victim.num_children or in_use(victim.block_id):
                # A sequence still reads it (evicting frees no room), or a T1 block hangs below
                # it while T1 is off (nothing to demote to, and only leaves are dropped).
                skipped.append(victim)
                victim = pop(t0, evictable)
                continue
            freed.append(victim.block_id)
            if victim.pinned:
                victim.pinned = False
                num_unpinned += 1
            victim.tier = GONE
            del nodes[victim.block_hash]
            victim.namespace.num_blocks -= 1
            dropped.append(victim)
            need -= 1
            parent = victim.parent
            if parent is not None:
                parent.num_children -= 1
                parent.num_t0_children -= 1
                # `_evictable_t0(parent)` spelled out (once per victim): a leaf of T0 now?
                if (not parent.num_t0_children and parent.tier == t0 and not parent.ref_count
                        and parent.namespace.valid):
                    if not need:
                        policy.push(parent, evictable)
                        break
                    if push_pop is not None:
                        victim = push_pop(parent, evictable)
                    else:
                        policy.push(parent, evictable)
                        victim = pop(t0, evictable)
                    continue
            if not need:
                break
            victim = pop(t0, evictable)
        slots.free(freed)
        self.slots.num_pinned -= num_unpinned
        self.counters[t0].num_evictions += len(dropped)
        plan.dropped_from = [t0] * len(dropped)
        for node in skipped:
            self.push(node)
        return plan

    def _reclaim_demoting(self, num_free: int) -> Plan:
        """`reclaim` with a T1: a victim T1 admits is demoted (copied), the others dropped."""
        plan = Plan()
        slots = self.allocators[Tier.T0]
        skipped: list[BlockNode] = []
        demoted: list[BlockNode] = []
        while slots.num_free < num_free:
            victim = self._pop_victim(Tier.T0)
            if victim is None:
                break
            if slots.in_use(victim.block_id) or not self._evict(victim, plan):
                skipped.append(victim)
            elif victim.tier == Tier.T1:
                demoted.append(victim)
        for node in skipped:
            self.push(node)
        self.order_demotions(demoted, plan)
        self.release_held(plan.held)
        return plan

    def order_demotions(self, demoted: list[BlockNode], plan: Plan) -> None:
        """Victims go leaf first, so a demoted chain would land in T1 slots in reverse order and
        a later T1 hit would cost one copy per block. The copies have not run yet: hand the same
        T1 slots out again in chain order (root first, chain by chain), so each chain is one run."""
        if len(demoted) < 2:
            return

        def chain_order(node: BlockNode) -> tuple[int, int]:
            depth, top = 0, node
            while top.parent is not None:
                top, depth = top.parent, depth + 1
            return id(top), depth

        new_ids = sorted(n.block_id for n in demoted)
        remap: dict[int, int] = {}
        for node, new_id in zip(sorted(demoted, key=chain_order), new_ids, strict=True):
            remap[node.block_id] = new_id
            node.block_id = new_id
        plan.moves = [
            Move(m.src_tier, m.src_id, m.dst_tier, remap.get(m.dst_id, m.dst_id))
            if m.src_tier == Tier.T0 and m.dst_tier == Tier.T1
            else m
            for m in plan.moves
        ]
