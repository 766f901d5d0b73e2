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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvfleet_runtime.cache import (
    BLOCK_SIZE,
    BlockHash,
    BlockNode,
    CacheConfig,
    CacheKey,
    CacheManager,
    CacheStats,
    Commit,
    KVLayout,
    StoreOutcome,
    StorePlan,
    Tier,
)

__all__ = ["ConnectorIndex", "LoadPlan", "SavePlan"]


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


@dataclass(slots=True)
class _Step:
    step_id: int
    holds: list[list[BlockNode]] = field(default_factory=list)
    commits: dict[int, Commit] = field(default_factory=dict)


class ConnectorIndex:
    """kvfleet's cache policy over a host pool of `num_slots` blocks, for one vLLM engine."""

    def __init__(
        self, layout: KVLayout, num_slots: int, *, vllm_block_size: int,
        clock: Callable[[], float], config: CacheConfig | None = None,
    ) -> None:
        if vllm_block_size <= 0 or vllm_block_size % BLOCK_SIZE:
            raise ValueError(f"vLLM block size must be a multiple of {BLOCK_SIZE} for the "
                             f"kvfleet connector, got {vllm_block_size}")
        base = config or CacheConfig(num_t0_blocks=0, num_t1_blocks=num_slots)
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

    # -- scheduling ------------------------------------------------------------------------

    def _usable(self, path: list[BlockNode]) -> int:
        for i, node in enumerate(path):
            if node.block_hash in self._pending or node.block_hash in self._poisoned:
                return i
        return len(path)

    def _limit_tokens(self, num_prompt_tokens: int) -> int:
        # vLLM must compute at least the prompt's last token: a hit stops a block short of it.
        vbs = self.vllm_block_size
        return max(0, (num_prompt_tokens - 1) // vbs * vbs)

    def num_matched(self, key: CacheKey, token_ids: Sequence[int], num_local_tokens: int) -> int:
        """Tokens the host pool holds beyond vLLM's own (block-aligned) hit of
        `num_local_tokens`, in whole vLLM blocks; 0 when it holds no more than vLLM."""
        limit = self._limit_tokens(len(token_ids))
        if limit <= num_local_tokens:
            return 0
        hashes, _ = self.manager.hashes(key, token_ids[:limit], lookup=True)
        path = self.manager.index.match(hashes)
        matched = self._usable(path) * BLOCK_SIZE // self.vllm_block_size * self.vllm_block_size
        return max(0, matched - num_local_tokens)

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
        if req_id in self._counted:
            path = self.manager.index.match(hashes)
            if path:
                self.manager.index.acquire(path)
        else:
            self._counted.add(req_id)
            self._count(key.tenant_id, "lookup_tokens", len(token_ids))
            # The denominator is the whole prompt, like vLLM's own prefix-cache metric.
            path = self.manager.lookup(key, hashes, len(token_ids),
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

    def store(self, req_id: str, key: CacheKey, token_ids: Sequence[int]) -> SavePlan | None:
        """The request's prompt is fully computed this step: one sighting of each full block;
        what admission accepts gets slots (written by the workers this step)."""
        hashes, platform_blocks = self.manager.hashes(key, token_ids)
        plan = self.manager.plan_store(key, list(hashes), platform_blocks)
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

    def _commit(self, plan: StorePlan) -> Commit:
        commit = self.manager.commit(plan)
        # Only the host tier exists: nothing moves between tiers, every node is a T1 slot.
        assert not commit.moves and all(n.tier == Tier.T1 for n in commit.nodes)
        return commit

    def end_step(self) -> int:
        """Close this step's plans (they go out in its metadata); returns its id."""
        step = self._step
        self._in_flight.append(step)
        self._step = _Step(step.step_id + 1)
        return step.step_id

    def step_done(self, step_id: int, failed_store_ids: set[int]) -> None:
        """The workers finished step `step_id` (and every step before it)."""
        while self._in_flight and self._in_flight[0].step_id <= step_id:
            step = self._in_flight.popleft()
            for path in step.holds:
                self.manager.release(path)
            for store_id, commit in step.commits.items():
                for node in commit.nodes:
                    self._pending.discard(node.block_hash)
                    if store_id in failed_store_ids:
                        self._poisoned.add(node.block_hash)
                self.manager.finish_commit(commit)
        self._drain_events()

    def request_finished(self, req_id: str) -> None:
        self._counted.discard(req_id)
        self._loaded.discard(req_id)

    def _count(self, tenant: str, name: str, n: int) -> None:
        per = self._deltas.setdefault(tenant, {})
        per[name] = per.get(name, 0) + n

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

    # -- observation -----------------------------------------------------------------------

    def stats(self, tenant: str | None = None) -> CacheStats:
        return self.manager.stats(tenant)

    @property
    def num_referenced_blocks(self) -> int:
        """Blocks some step in flight still references (0 once every step is done)."""
        return sum(1 for n in self.manager.index.nodes() if n.ref_count)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight) + bool(self._step.holds or self._step.commits)
