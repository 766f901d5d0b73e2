"""The scheduler side of the connector, without vLLM types: kvfleet's `CacheManager` (index,
admission, placement, stats) over the host pool's slots, plus what a step in flight holds.

Lifecycle of one engine step, as vLLM's scheduler drives it:

    num_matched(...)        while scheduling: how many tokens beyond vLLM's own prefix hit the
                            host pool can supply (no references, no stats: vLLM may ask again)
    admit(...)              after vLLM allocated blocks: the lookup that counts (once per request)
                            and, when vLLM chose to load, references on the blocks to load
    store(...)              when a request's prefill completes this step: admission decides, the
                            admitted blocks are indexed as pending and given slots
    end_step() -> step id   the plans above travel to the workers in this step's metadata
    step_done(id, failed)   the workers finished the step: loads release their references,
                            written stores become visible, failed ones are never served

A pending block is indexed (so its slot is reserved) but cut from every match until its step is
done: a lookup in the next step must not plan a load from a slot no worker has written yet.

T2 (`kvfleet_vllm._peer` drives these from its own thread; every method takes the index's lock):

    fetch_want(...)         what a peer could add after the host pool's usable match
    reserve(want, n)        slots for n fetched blocks, indexed pending exactly like a save
    fetch_done(res, n)      the first n were written and verified: visible; the rest never served
    export(...) / held(...) what peers may read of this pool: visible blocks only, referenced
                            while a transfer reads them

Listeners (`add_listener`) get a block's "stored" event when it becomes visible (a save whose
step is done, a verified fetch), not when its slot is reserved, and every "removed" event: the
hint index never points a peer at a slot nobody has written.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    PLATFORM_TENANT,
    BlockEvent,
    BlockHash,
    BlockNode,
    CacheKey,
    CacheManager,
    CacheStats,
    CacheTuning,
    Commit,
    KVLayout,
    StoreOutcome,
    StorePlan,
    Tier,
    block_events,
    usable_tokens,
)

__all__ = ["ConnectorIndex", "FetchWant", "LoadPlan", "Reservation", "SavePlan"]


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(
    method: Callable[Concatenate[ConnectorIndex, _P], _R],
) -> Callable[Concatenate[ConnectorIndex, _P], _R]:
    def locked(self: ConnectorIndex, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.lock:
            return method(self, *args, **kwargs)

    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


@dataclass(slots=True, frozen=True)
class LoadPlan:
    """Copy host slot `slots[i]` into the request's chain block `chain_blocks[i]`. `failed`:
    the blocks are gone; the worker reports them as load errors so vLLM recomputes them."""

    req_id: str
    chain_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    failed: bool = False


@dataclass(slots=True, frozen=True)
class SavePlan:
    """Copy the request's chain blocks `chain_blocks[i]` into host slot `slots[i]`."""

    store_id: int
    req_id: str
    chain_blocks: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class FetchWant:
    """A request's chain up to its usable limit, of which the host pool serves the first
    `start_block` blocks: a peer may supply blocks from there on."""

    key: CacheKey
    chain: tuple[BlockHash, ...]
    start_block: int
    platform_blocks: int
    useful_blocks: int
    """Blocks beyond which a fetch supplies something vLLM does not already hold itself."""


@dataclass(slots=True)
class Reservation:
    """Host slots for fetched blocks `[commit.first_block, + len(slots))` of `want.chain`,
    indexed pending until `fetch_done`."""

    want: FetchWant
    commit: Commit
    slots: tuple[int, ...]

    @property
    def start_block(self) -> int:
        return self.commit.first_block


@dataclass(slots=True)
class _Step:
    step_id: int
    holds: list[list[BlockNode]] = field(default_factory=list)
    commits: dict[int, Commit] = field(default_factory=dict)


class ConnectorIndex:
    """kvfleet's cache policy over a host pool of `num_slots` blocks, for one vLLM engine."""

    def __init__(
        self, layout: KVLayout, num_slots: int, *, vllm_block_size: int,
        clock: Callable[[], float], config: CacheTuning | None = None,
    ) -> None:
        if vllm_block_size <= 0 or vllm_block_size % BLOCK_SIZE:
            raise ValueError(f"vLLM block size must be a multiple of {BLOCK_SIZE} for the "
                             f"kvfleet connector, got {vllm_block_size}")
        base = config or CacheTuning(num_t0_blocks=0, num_t1_blocks=num_slots)
        if base.num_t0_blocks or base.num_t1_blocks != num_slots:
            raise ValueError("the connector's cache config has only the host tier (T1): "
                             f"num_t0_blocks=0, num_t1_blocks={num_slots}")
        self.layout = layout
        self.vllm_block_size = vllm_block_size
        self.manager = CacheManager(base, bytes_per_block=layout.bytes_per_block, clock=clock)
        self._counted: set[str] = set()
        self._loaded: set[str] = set()
        self._pending: set[BlockHash] = set()
        self._poisoned: set[BlockHash] = set()
        self._in_flight: deque[_Step] = deque()
        self._step = _Step(0)
        self._next_store_id = 0
        self._deltas: dict[str, dict[str, int]] = {}
        self._listeners: list[Callable[[BlockEvent], None]] = []
        self.lock = threading.RLock()
        """Taken by every method: the scheduler thread and the T2 thread share the index."""

    def add_listener(self, callback: Callable[[BlockEvent], None]) -> None:
        """`callback(event)` for each block that became visible ("stored") or left ("removed");
        called with the index's lock held, so it must not block (`HintPublisher.offer_*`)."""
        self._listeners.append(callback)

    # -- scheduling ------------------------------------------------------------------------

    def _usable(self, path: list[BlockNode]) -> int:
        for i, node in enumerate(path):
            if node.block_hash in self._pending or node.block_hash in self._poisoned:
                return i
        return len(path)

    def _limit_tokens(self, num_prompt_tokens: int) -> int:
        return usable_tokens(num_prompt_tokens, self.vllm_block_size)

    @_locked
    def num_matched(self, key: CacheKey, token_ids: Sequence[int], num_local_tokens: int) -> int:
        """Tokens the host pool holds beyond vLLM's own (block-aligned) hit of
        `num_local_tokens`, in whole vLLM blocks; 0 when it holds no more than vLLM."""
        limit = self._limit_tokens(len(token_ids))
        if limit <= num_local_tokens:
            return 0
        hashes, _ = self.manager.hashes(key, token_ids[:limit], lookup=True)
        path = self.manager.match(hashes)
        matched = self._usable(path) * BLOCK_SIZE // self.vllm_block_size * self.vllm_block_size
        return max(0, matched - num_local_tokens)

    @_locked
    def admit(
        self, req_id: str, key: CacheKey, token_ids: Sequence[int], num_local_tokens: int,
        num_external_tokens: int,
    ) -> LoadPlan | None:
        """vLLM allocated the request's blocks and will load `num_external_tokens` after its
        own `num_local_tokens`. The first admission of a request is its lookup in the stats
        (only tokens beyond vLLM's own hit count as hits); a preempted request re-admitted
        loads again without being counted again."""
        limit = self._limit_tokens(len(token_ids))
        hashes, _ = self.manager.hashes(key, token_ids[:limit], lookup=True)
        # Only what a load could read: pending (unwritten) and poisoned blocks are no hit.
        matched = self.manager.match(hashes)
        usable = [n.block_hash for n in matched[:self._usable(matched)]]
        if req_id in self._counted:
            path = self.manager.match(usable)
            if path:
                self.manager.acquire(path)
        else:
            self._counted.add(req_id)
            self._count(key.tenant_id, "lookup_tokens", len(token_ids))
            # The denominator is the whole prompt, like vLLM's own prefix-cache metric.
            path = self.manager.lookup(key, usable, len(token_ids),
                                       num_local_tokens=num_local_tokens)
        if num_external_tokens <= 0:
            if path:
                self.manager.release(path)
            return None
        first = num_local_tokens // BLOCK_SIZE
        end = (num_local_tokens + num_external_tokens) // BLOCK_SIZE
        chain = tuple(range(first, end))
        if self._usable(path) < end:
            # Evicted or poisoned since `num_matched` (never within one scheduling pass):
            # the worker reports the blocks and vLLM recomputes them.
            if path:
                self.manager.release(path)
            return LoadPlan(req_id, chain, (), failed=True)
        self._step.holds.append(path)
        if req_id not in self._loaded:
            # The tokens this connector supplies, once per request: what the fleet's hit-rate
            # series count for a vLLM replica, beside vLLM's own prefix-cache hits.
            self._loaded.add(req_id)
            self._count(key.tenant_id, "matched_tokens", num_external_tokens)
        return LoadPlan(req_id, chain, tuple(path[j].block_id for j in chain))

    @_locked
    def store(self, req_id: str, key: CacheKey, token_ids: Sequence[int]) -> SavePlan | None:
        """The request's prompt is fully computed this step: one sighting of each full block;
        what admission accepts gets slots (written by the workers this step). Blocks whose
        slots a failed fetch or save left unwritten are rewritten first, in place."""
        hashes, platform_blocks = self.manager.hashes(key, token_ids)
        chain = list(hashes)
        commit = self._repair(chain)
        if commit is None:
            plan = self.manager.plan_store(key, chain, platform_blocks)
            if isinstance(plan, StoreOutcome):
                self._drain_events()
                return None
            commit = self._commit(plan)
        if not commit.nodes:
            self.manager.finish_commit(commit)
            self._drain_events()
            return None
        store_id = self._next_store_id
        self._next_store_id += 1
        self._step.commits[store_id] = commit
        for node in commit.nodes:
            self._pending.add(node.block_hash)
        self._drain_events()
        self._count(key.tenant_id, "stored_blocks", len(commit.nodes))
        first = commit.first_block
        return SavePlan(store_id, req_id, tuple(range(first, first + len(commit.nodes))),
                        tuple(n.block_id for n in commit.nodes))

    def _repair(self, chain: list[BlockHash]) -> Commit | None:
        """The chain's poisoned blocks right after its visible prefix (a fetch or a save that
        failed reserved them and they are still indexed), taken back for this request's own
        KV: without this, `plan_store` would find them resident and never store them again.
        None when there are none."""
        path = self.manager.match(chain)
        first = end = self._usable(path)
        while end < len(path) and path[end].block_hash in self._poisoned:
            end += 1
        if end == first:
            return None
        nodes = path[first:end]
        self.manager.acquire(nodes)  # released by finish_commit when the step is done
        for node in nodes:
            self._poisoned.discard(node.block_hash)
        return Commit(nodes, first)

    def _commit(self, plan: StorePlan) -> Commit:
        commit = self.manager.commit(plan)
        # Only the host tier exists: nothing moves between tiers, every node is a T1 slot.
        assert not commit.moves and all(n.tier == Tier.T1 for n in commit.nodes)
        return commit

    @_locked
    def end_step(self) -> int:
        """Close this step's plans (they go out in its metadata); returns its id."""
        step = self._step
        self._in_flight.append(step)
        self._step = _Step(step.step_id + 1)
        return step.step_id

    @_locked
    def step_done(self, step_id: int, failed_store_ids: set[int]) -> None:
        """The workers finished step `step_id` (and every step before it)."""
        while self._in_flight and self._in_flight[0].step_id <= step_id:
            step = self._in_flight.popleft()
            for path in step.holds:
                self.manager.release(path)
            for store_id, commit in step.commits.items():
                failed = store_id in failed_store_ids
                for node in commit.nodes:
                    self._pending.discard(node.block_hash)
                    if failed:
                        self._poisoned.add(node.block_hash)
                self.manager.finish_commit(commit)
                if not failed:
                    self._announce(commit.nodes)
        self._drain_events()

    @_locked
    def request_finished(self, req_id: str) -> None:
        self._counted.discard(req_id)
        self._loaded.discard(req_id)

    def _count(self, tenant: str, name: str, n: int) -> None:
        per = self._deltas.setdefault(tenant, {})
        per[name] = per.get(name, 0) + n

    @_locked
    def take_deltas(self) -> dict[str, dict[str, int]]:
        """Per tenant, what happened since the last call: `lookup_tokens` (prompt tokens of
        admitted requests, once each), `matched_tokens` (tokens loaded from the host pool beyond
        vLLM's own hit, once each), `stored_blocks`. vLLM ships these to its frontend, which
        exports them (`KvfleetConnector.build_prom_metrics`)."""
        deltas, self._deltas = self._deltas, {}
        return deltas

    def _drain_events(self) -> None:
        for event in self.manager.drain_events():
            if event.kind == "removed":
                # A poisoned block's slot went back to the pool: its next store is a fresh one.
                self._poisoned.difference_update(event.block_hashes)
                for listener in self._listeners:
                    listener(event)
            # "stored" at commit means a reserved slot: announced once written (`_announce`).

    def _announce(self, nodes: Sequence[BlockNode]) -> None:
        if not self._listeners or not nodes:
            return
        for event in block_events("stored", nodes):
            for listener in self._listeners:
                listener(event)

    # -- T2: fetching from peers, serving them ----------------------------------------------

    @_locked
    def fetch_want(self, key: CacheKey, token_ids: Sequence[int], num_local_tokens: int,
                   min_blocks: int) -> FetchWant | None:
        """What a peer could add to this request: None when the host pool (or vLLM itself)
        already holds all but fewer than `min_blocks` of the usable prefix, or when a save or a
        fetch of the next block is already in flight."""
        limit = self._limit_tokens(len(token_ids))
        hashes, platform_blocks = self.manager.hashes(key, token_ids[:limit])
        chain = tuple(hashes)
        path = self.manager.match(chain)
        usable = self._usable(path)
        if usable < len(path):
            return None  # the next block is pending (written this step) or poisoned
        have = max(usable, num_local_tokens // BLOCK_SIZE)
        if len(chain) - have < min_blocks:
            return None
        return FetchWant(key, chain, usable, platform_blocks, have)

    @_locked
    def reserve(self, want: FetchWant, num_blocks: int) -> Reservation | None:
        """Index blocks `[want.start_block, + num_blocks)` of the chain as pending, with host
        slots (as many as fit, evicting like any write; the import policy is
        `CacheManager.plan_import`'s, as for `PrefixCache._import_blocks`). None when the chain
        changed since `want`, or no room."""
        end = min(len(want.chain), want.start_block + num_blocks)
        chain = list(want.chain[:end])
        if end <= want.start_block:
            return None
        plan = self.manager.plan_import(want.key, chain, want.platform_blocks,
                                        start_block=want.start_block)
        if plan is None or self._usable(self.manager.match(chain[:plan.start_block])) != (
                plan.start_block):
            return None
        commit = self._commit(plan)
        self._drain_events()
        if not commit.nodes or commit.first_block != want.start_block:
            self.manager.finish_commit(commit)
            return None
        for node in commit.nodes:
            self._pending.add(node.block_hash)
        return Reservation(want, commit, tuple(n.block_id for n in commit.nodes))

    @_locked
    def fetch_done(self, reservation: Reservation, num_written: int) -> None:
        """The first `num_written` reserved blocks hold verified KV: they become visible (and
        are announced); the rest are never served (cut from every match until evicted)."""
        nodes = reservation.commit.nodes
        for i, node in enumerate(nodes):
            self._pending.discard(node.block_hash)
            if i >= num_written:
                self._poisoned.add(node.block_hash)
        self.manager.finish_commit(reservation.commit)
        self._announce(nodes[:num_written])
        if num_written:
            self._count(reservation.want.key.tenant_id, "fetched_blocks", num_written)
        self._drain_events()

    @_locked
    def export(self, key: CacheKey, token_ids: Sequence[int], start_block: int,
               max_blocks: int) -> list[BlockNode] | None:
        """The visible run of (key, token_ids) from `start_block` (at most `max_blocks`),
        referenced until `release_export`: its slots cannot be reused while a peer reads them.
        No stats: serving a peer is not a lookup of this replica's. ValueError for a key the
        cache refuses."""
        hashes, _ = self.manager.hashes(key, token_ids)
        path = self.manager.match(hashes)
        run = path[start_block:min(self._usable(path), start_block + max_blocks)]
        if not run:
            return None
        self.manager.acquire(run)
        return run

    @_locked
    def release_export(self, run: list[BlockNode]) -> None:
        self.manager.release(run)
        self._drain_events()

    @_locked
    def held(self, hashes: Sequence[bytes], tenant: str) -> int:
        """Leading blocks of the chain `hashes` visible here for `tenant` (or the platform):
        the held probe of peers whose hint index asks the replicas themselves."""
        path = self.manager.match(BlockHash(h) for h in hashes)
        for i, node in enumerate(path[:self._usable(path)]):
            if node.namespace.key.tenant_id not in (tenant, PLATFORM_TENANT):
                return i
        return self._usable(path)

    # -- observation -----------------------------------------------------------------------

    @_locked
    def stats(self, tenant: str | None = None) -> CacheStats:
        return self.manager.stats(tenant)

    @property
    def num_referenced_blocks(self) -> int:
        """Blocks some step, fetch or transfer in flight still references (0 once all are
        done)."""
        with self.lock:
            return self.manager.num_referenced_blocks()

    @property
    def num_steps_in_flight(self) -> int:
        with self.lock:
            return len(self._in_flight) + bool(self._step.holds or self._step.commits)

    @property
    def num_pending_blocks(self) -> int:
        """Indexed blocks not yet written and checked (saves in flight, fetches in flight)."""
        with self.lock:
            return len(self._pending)
