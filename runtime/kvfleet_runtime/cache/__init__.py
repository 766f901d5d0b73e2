"""The prefix-KV cache inside every replica (docs/design.md §2, R3-R5).

Public facade (what the replica engine and the fleet tier code against)::

    key = CacheKey(tenant_id, model_id, weights_digest="sha256:<64 hex>", kv_dtype,
                   rope_config_hash, attn_impl_id)          # TP degree is not part of it
    kv = PagedKV.allocate(model_args, num_blocks, device=device)   # the engine's KV
    cache = PrefixCache(CacheTuning(num_t0_blocks=num_blocks, num_t1_blocks=...),
                        KVLayout(num_layers, num_kv_heads, head_dim, dtype="float16"),
                        clock=time.monotonic, device_kv=kv, registry=prometheus_registry)

    # The engine's path: T0 is `kv` itself, one pool for in-flight sequences and cached prefixes
    prefix = cache.prepare(key, token_ids, kv)    # lookup, the hit's T0 blocks shared (refs)
    table = prefix.table + kv.take(need - len(prefix.table))  # short: cached blocks reclaimed
    n = cache.fill(prefix, table)                 # T1 blocks copied in, one copy per run
    ...prefill token_ids[n:] into table...        # n <= usable_tokens(len(token_ids))
    cache.finish(prefix, token_ids, table)        # full blocks indexed in place; refs released
    kv.give_back(table)                           # at request end (cached blocks stay cached)
    # (its steps, `_share_prefix`, `_copy_into`, `_store_blocks`, are the package's own)

    # Tensors in, tensors out (benches, tests, TP shards):
    k, v = cache.materialize(hit, tp_degree=4, tp_rank=r)
    #   [num_layers, num_kv_heads // 4, hit.matched_tokens, head_dim], heads h % 4 == r
    cache.store(key, token_ids, k_all, v_all)     # -> StoreOutcome; copied by the drain
    cache.drain_store_queue()                     # background thread / asyncio.to_thread
    cache.invalidate(weights_digest) -> int       # POST /cache/invalidate {model_version}
    cache.stats(tenant=None) -> CacheStats        # GET /cache/stats?tenant=

    # Hooks for the fleet tier (T2):
    cache.read_blocks(hashes) -> (k, v) | None    # export held blocks, canonical layout
    cache.add_listener(callback)                  # BlockEvent("stored"|"removed", key, hashes)
    cache.set_eviction_sink(callback)             # EvictedRun: what T1 drops, with its data (T3)

    # The tiers below the cache (T3, T2), asked by the engine after T0 and T1 (`_lower`):
    class MyTier(LowerTier): name = "t3"; num_matched(TierQuery) -> int | None;
                             load_into(TierQuery, LoadTarget, done); forget(TierQuery)

Layouts: T0 is the engine's `[num_layers, num_blocks, num_kv_heads, 16, head_dim]` (what
attention reads), and so is T1 (a T1 hit is a straight copy per run into the engine's blocks);
everything that leaves the replica is the canonical TP-agnostic `[num_layers, num_kv_heads,
tokens, head_dim]`. Chained hashes: `block_hashes(key,
token_ids)` (blake2b-128, see `_keys.py`). Thread-safety: `PrefixCache` takes one lock per call
(the device pool's, which the engine's allocations take too); the store queue is a thread-safe
bounded priority queue.

Modules, top to bottom: `_cache` (facade, torch) -> `_manager` (the one door to the index, the
sketch and admission; placement, stats, events) -> `_block_index` (radix index, tiers, refs,
eviction; it owns its slots, `_tier_slots`, and its drains, `_tier_drains`; its nodes in
`_block_node`, audited by `_index_audit`) -> `_moves` (`Move`, `Plan`: what the index plans and
`_pool` carries out) and `_allocator` (free slots; `BlockRefs`, the device pool's ref counts
shared by sequences and the cache); `_pool` holds the tensors; `_lower` is the interface of the
tiers below (T3, T2); `_keys`, `_sketch`, `_admission`, `_ghosts`, `_eviction`, `_reuse`,
`_store_queue`, `_stats`, `_metrics` and `_config` are pure. Importing this package does not
import torch: `PrefixCache`, `Prefix`, `Hit`, `Miss` and `PagedBlocks` load on first use.
Replays (the lab's policy comparison, the fleet simulator) drive the shipped policy through
`CacheManager.replay`, with no tensors.

A second facade over `CacheManager` (the vLLM connector, `kvfleet_vllm`, whose pool is vLLM's
host-pool file) drives the manager through its own methods, never the index below it: `hashes`,
`match` / `acquire` / `lookup` / `release`, `plan_store` or `plan_import` -> `StorePlan`, `commit`
-> `Commit` (its `BlockNode`s), `finish_commit`, `drain_events`; `block_events` groups nodes
into events; `key_digest` validates a key's fields; `continue_chain` chains blocks onto a known
hash (the router's view of vLLM's KV events); `paired_runs` turns two id lists into runs
of consecutive ids (one copy each); `usable_tokens` is the last-prompt-token rule, for every
tier and both facades.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet_runtime.cache._allocator import BlockRefs, paired_runs
from kvfleet_runtime.cache._block_node import BlockNode
from kvfleet_runtime.cache._config import CacheTuning, KVLayout
from kvfleet_runtime.cache._keys import (
    BLOCK_SIZE,
    PLATFORM_TENANT,
    BlockHash,
    CacheKey,
    block_hashes,
    continue_chain,
    key_digest,
    usable_tokens,
)
from kvfleet_runtime.cache._lower import LoadTarget, LowerTier, TierQuery
from kvfleet_runtime.cache._manager import (
    BlockEvent,
    CacheManager,
    Commit,
    StoreOutcome,
    StorePlan,
    block_events,
)
from kvfleet_runtime.cache._moves import Tier
from kvfleet_runtime.cache._stats import CacheStats, TenantStats, TierStats

if TYPE_CHECKING:
    from kvfleet_runtime.cache._cache import EvictedRun, Hit, Miss, Prefix, PrefixCache
    from kvfleet_runtime.cache._pool import PagedBlocks

# What the facades' users (engine, server, fleet and local tiers, router) and the vLLM
# connector use; the index, the sketch, admission, the pools and the store queue stay private
# to the package (tests/test_imports.py holds this list).
__all__ = [
    "BLOCK_SIZE",
    "PLATFORM_TENANT",
    "BlockEvent",
    "BlockHash",
    "BlockNode",
    "BlockRefs",
    "CacheKey",
    "CacheManager",
    "CacheStats",
    "CacheTuning",
    "Commit",
    "EvictedRun",
    "Hit",
    "KVLayout",
    "LoadTarget",
    "LowerTier",
    "Miss",
    "PagedBlocks",
    "Prefix",
    "PrefixCache",
    "StoreOutcome",
    "StorePlan",
    "TenantStats",
    "Tier",
    "TierQuery",
    "TierStats",
    "block_events",
    "block_hashes",
    "continue_chain",
    "key_digest",
    "paired_runs",
    "usable_tokens",
]

_TORCH_EXPORTS = {
    "EvictedRun": "_cache",
    "Hit": "_cache",
    "Miss": "_cache",
    "PagedBlocks": "_pool",
    "Prefix": "_cache",
    "PrefixCache": "_cache",
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
