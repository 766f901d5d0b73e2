"""The tiers below the cache (T3 NVMe, T2 peers): what the engine asks them, and where they land.

The engine's prepare asks T0 and T1 first (the cache's own `prepare` / `fill`), then each lower
tier in the composition root's order (T3, then T2), each for the blocks after those the tiers
before it supply. The shape is vLLM's scheduler and connector: ask once (`num_matched`), allocate
once, then every load lands in the blocks the engine allocated (`load_into`), and the request
resumes prefill after the leading blocks that landed verified. A tier never blocks the engine's
thread: a lookup still in flight answers None (asked again next step), a load reports through
`done` from any thread. Every failure is a recompute (`done(0)`), never wrong data.

Pure: importing this module does not import torch (`PagedBlocks` is a type only here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvfleet_runtime.cache._keys import BlockHash, CacheKey

if TYPE_CHECKING:
    from kvfleet_runtime.cache._pool import PagedBlocks

__all__ = ["LoadTarget", "LowerTier", "TierQuery"]


@dataclass(frozen=True, slots=True)
class TierQuery:
    """One request's ask of a lower tier. The chain is hashed once (by the cache's prepare)."""

    request_id: int
    """The engine's id of the request: the same for every ask, load and `forget` of it."""
    key: CacheKey
    token_ids: tuple[int, ...]
    """The prompt."""
    chain: tuple[BlockHash, ...]
    """The usable blocks' chain (the `usable_tokens` rule: never the block holding the last
    prompt token), platform prefixes scoped as the cache files them."""
    start_block: int
    """Blocks already supplied by T0/T1 and by the tiers asked before this one."""


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """Where a lower tier lands blocks [query.start_block, +len(block_ids)): the engine's own
    pool (T0 `PagedBlocks`, layout [layers, blocks, heads, 16, head_dim] for K and for V, one
    allocation: `kv.kv` is both as `[2, layers, blocks, heads, 16, head_dim]`) and the fresh
    block ids the engine allocated for exactly those blocks (one user ref each, the request's)."""

    kv: PagedBlocks
    block_ids: tuple[int, ...]


@runtime_checkable
class LowerTier(Protocol):
    """A tier below the cache, asked by the engine's prepare (module docstring)."""

    name: str
    """"t3" | "t2": the `cache_tier` label a hit it supplied reports."""

    def num_matched(self, query: TierQuery) -> int | None:
        """Blocks after query.start_block this tier will supply (0: none). None: still finding
        out (an index lookup in flight): the engine leaves the request waiting and asks again at
        its next step. Never blocks and never does I/O on the calling (engine) thread."""
        ...

    def load_into(
        self, query: TierQuery, target: LoadTarget, done: Callable[[int], None]
    ) -> None:
        """Start landing the matched blocks into `target`; call `done(n)` exactly once, from any
        thread, with how many LEADING blocks landed verified (0 on any failure: recompute).
        Never blocks the caller. The blocks are the engine's until done is called."""
        ...

    def forget(self, query: TierQuery) -> None:
        """The request left (cancelled, or not loading after all): drop its lookup/fetch state."""
        ...
