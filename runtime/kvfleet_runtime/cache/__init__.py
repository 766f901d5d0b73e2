"""The prefix-KV cache inside every replica (docs/design.md §2, R3-R5).

Public facade (what the replica engine and the fleet tier code against)::

    key = CacheKey(tenant_id, model_id, weights_digest="sha256:<64 hex>", kv_dtype,
                   rope_config_hash, attn_impl_id)          # TP degree is not part of it
    kv = PagedKV.allocate(model_args, num_blocks, device=device)   # the engine's KV
    cache = PrefixCache(CacheConfig(num_t0_blocks=num_blocks, num_t1_blocks=...),
                        KVLayout(num_layers, num_kv_heads, head_dim, dtype="float16"),
                        clock=time.monotonic, device_kv=kv, registry=prometheus_registry)

    # The engine's path: T0 is `kv` itself, one pool for in-flight sequences and cached prefixes
    hit = cache.lookup(key, token_ids)            # -> Hit | Miss; a Hit holds refs on its blocks
    shared = cache.share_prefix(hit, kv, n)       # the hit's T0 block ids, shared: no copy
    table = shared + kv.take(need - len(shared))  # short of room: cached blocks are reclaimed
    cache.copy_into(hit, kv, table, len(shared), n)   # T1 blocks: one copy per run, then T0
    ...prefill token_ids[n * 16:] into table...
    cache.store_blocks(key, token_ids, kv, table) # the prompt's full blocks, indexed in place
    kv.give_back(table); cache.release(hit)       # at request end

    # Tensors in, tensors out (benches, tests, TP shards):
    k, v = cache.materialize(hit, tp_degree=4, tp_rank=r)
    #   [num_layers, num_kv_heads // 4, hit.matched_tokens, head_dim], heads h % 4 == r
    cache.store(key, token_ids, k_all, v_all)     # -> StoreOutcome; copied by the drain
    cache.drain_store_queue()                     # background thread / asyncio.to_thread
    cache.invalidate(weights_digest) -> int       # POST /cache/invalidate {model_version}
    cache.stats(tenant=None) -> CacheStats        # GET /cache/stats?tenant=

    # Hooks for the fleet tier (T2):
    cache.read_blocks(hashes) -> (k, v) | None    # export held blocks, canonical layout
    cache.import_blocks(key, token_ids, k, v)     # insert blocks fetched from a peer
    cache.add_listener(callback)                  # BlockEvent("stored"|"removed", key, hashes)
    cache.set_eviction_sink(callback)             # EvictedRun: what T1 drops, with its data (T3)

Layouts: T0 is the engine's `[num_layers, num_blocks, num_kv_heads, 16, head_dim]` (what
attention reads); T1 and everything that leaves the replica is the canonical TP-agnostic
`[num_layers, num_kv_heads, num_blocks, 16, head_dim]`. Chained hashes: `block_hashes(key,
token_ids)` (blake2b-128, see `_keys.py`). Thread-safety: `PrefixCache` takes one lock per call
(the device pool's, which the engine's allocations take too); the store queue is a thread-safe
bounded priority queue.

Modules, top to bottom: `_cache` (facade, torch) -> `_manager` (admission, placement, stats) ->
`_index` (radix index, tiers, refs, eviction) -> `_allocator` (free slots; `BlockRefs`, the
device pool's ref counts shared by sequences and the cache); `_pool` holds the tensors; `_keys`,
`_sketch`, `_policy`, `_store_queue`, `_stats`, `_metrics` and `_config` are pure. Importing this
package does not import torch: `PrefixCache`, `Hit`, `Miss`, `PagedBlocks` and `TensorPool` load
on first use. Replays (the lab's policy comparison, the fleet simulator) drive the shipped policy
through `CacheManager.replay`, with no tensors.

A second facade over `CacheManager` (the vLLM connector, `kvfleet_vllm`, whose pool is vLLM's
host-pool file) drives the manager directly: `CacheManager.plan_store` -> `StorePlan`,
`commit` -> `Commit` (its `BlockNode`s), `finish_commit`; `key_digest` validates a key's fields;
`paired_runs` turns two id lists into runs of consecutive ids (one copy each).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet_runtime.cache._allocator import paired_runs
from kvfleet_runtime.cache._config import CacheConfig, KVLayout
from kvfleet_runtime.cache._index import BlockIndex, BlockNode, Tier
from kvfleet_runtime.cache._keys import (
    BLOCK_SIZE,
    PLATFORM_TENANT,
    BlockHash,
    CacheKey,
    ChainMemo,
    block_hashes,
    iter_block_hashes,
    key_digest,
)
from kvfleet_runtime.cache._manager import (
    BlockEvent,
    CacheManager,
    Commit,
    StoreOutcome,
    StorePlan,
)
from kvfleet_runtime.cache._policy import Placement
from kvfleet_runtime.cache._sketch import CountMinSketch
from kvfleet_runtime.cache._stats import CacheStats, TenantStats, TierStats
from kvfleet_runtime.cache._store_queue import StoreQueue

if TYPE_CHECKING:
    from kvfleet_runtime.cache._cache import EvictedRun, Hit, Miss, PrefixCache
    from kvfleet_runtime.cache._pool import PagedBlocks, TensorPool

__all__ = [
    "BLOCK_SIZE",
    "PLATFORM_TENANT",
    "BlockEvent",
    "BlockHash",
    "BlockIndex",
    "BlockNode",
    "CacheConfig",
    "CacheKey",
    "CacheManager",
    "CacheStats",
    "ChainMemo",
    "Commit",
    "CountMinSketch",
    "EvictedRun",
    "Hit",
    "KVLayout",
    "Miss",
    "PagedBlocks",
    "Placement",
    "PrefixCache",
    "StoreOutcome",
    "StorePlan",
    "StoreQueue",
    "TenantStats",
    "TensorPool",
    "Tier",
    "TierStats",
    "block_hashes",
    "iter_block_hashes",
    "key_digest",
    "paired_runs",
]

_TORCH_EXPORTS = {
    "EvictedRun": "_cache",
    "Hit": "_cache",
    "Miss": "_cache",
    "PagedBlocks": "_pool",
    "PrefixCache": "_cache",
    "TensorPool": "_pool",
}


def __getattr__(name: str) -> Any:
    # Deferred so the pure core (and the router and operator importing it) never pulls torch.
    module = _TORCH_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
