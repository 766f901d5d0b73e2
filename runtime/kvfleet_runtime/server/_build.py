"""The replica's composition root: a config -> the loaded model, its KV, the cache and its
tiers, the engine, the metrics (`build_replica`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
)

from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
)
from kvfleet_runtime.model import (
    PagedKV,
    default_device,
    load_checkpoint,
    onednn_packing_supported,
)
from kvfleet_runtime.nvme import NvmeConfig, NvmeStore, NvmeTier
from kvfleet_runtime.server._config import (
    CacheSettings,
    ReplicaConfig,
)
from kvfleet_runtime.server._state import Replica
from kvfleet_runtime.tokenizer import load_tokenizer


def build_replica(config: ReplicaConfig, *, config_path: Path | None = None,
                  overrides: Mapping[str, Any] | None = None,
                  registry: CollectorRegistry | None = None) -> Replica:
    """Load the model and build the cache and engine (no server yet)."""
    if not config.model_dir:
        raise ValueError("model_dir is not set (flag --model-dir, config file or "
                         "KVFLEET_REPLICA_MODEL_DIR)")
    device = default_device() if config.device == "auto" else torch.device(config.device)
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    # The tokenizer first: a folder we cannot tokenize for is refused before the weights load.
    tokenizer = load_tokenizer(Path(config.model_dir))
    # A refused config, a checkpoint that does not match it, or weights with another digest
    # than expected: ValueError naming the problem (the CLI prints it, no traceback).
    loaded = load_checkpoint(Path(config.model_dir), device=device, attn_impl=config.attn_impl,
                             dtype=config.dtype,
                             expected_digest=config.expected_weights_digest or None)
    model = loaded.model
    if config.pack_weights and onednn_packing_supported(device, model.embed_tokens.weight.dtype):
        model.pack_linear_weights()
    if tokenizer.vocab_size > loaded.args.vocab_size:
        raise ValueError(f"{config.model_dir}: the tokenizer has {tokenizer.vocab_size} ids but "
                         f"the model's vocabulary has {loaded.args.vocab_size} (vocab_size in "
                         "config.json): the tokenizer is not this model's")
    model_id = config.model_id or Path(config.model_dir).resolve().name
    registry = registry or CollectorRegistry()
    args = loaded.args
    cache_cfg = config.cache
    e = config.engine
    # One block pool per device: the engine's KV is the cache's T0 (cached prefixes and
    # in-flight sequences compete for the same blocks). Always bound, so that T0 can be turned
    # on and off live (`cache.t0_enabled`, the fleet config's `tiers.t0_device`).
    kv = PagedKV.allocate(args, e.num_kv_blocks, device=device)
    cache = PrefixCache(
        CacheTuning(num_t0_blocks=e.num_kv_blocks,
                    num_t1_blocks=cache_cfg.num_t1_blocks,
                    admit_min_sightings=cache_cfg.admit_min_sightings,
                    store_queue_max_entries=cache_cfg.store_queue_max_entries),
        KVLayout(args.n_layers, args.n_kv_heads, args.head_dim, dtype=args.dtype),
        clock=time.monotonic,
        device=device,
        registry=registry,
        device_kv=kv,
    )
    if not cache_cfg.t0_enabled:
        cache.set_t0_enabled(False)
    engine = Engine(
        loaded.model,
        CacheKeyFields.for_model(loaded, model_id, deterministic=config.engine.deterministic),
        cache=cache if cache_cfg.enabled else None,
        config=EngineConfig(num_kv_blocks=e.num_kv_blocks, max_batch_size=e.max_batch_size,
                            max_waiting=e.max_waiting,
                            max_tokens_per_step=e.max_tokens_per_step,
                            deterministic=e.deterministic,
                            stop_ids=tokenizer.stop_ids),
        registry=registry,
        kv=kv,
    )
    nvme = _build_nvme(cache, cache_cfg, registry)
    replica = Replica(config=config, boot_config=config, loaded=loaded, model_id=model_id,
                      tokenizer=tokenizer, nvme=nvme,
                      engine=engine, cache=cache, registry=registry, config_path=config_path,
                      overrides=dict(overrides or {}),
                      reloads=Counter("kvfleet_replica_config_reloads", "Config file reloads.",
                                      ["result"], registry=registry))
    replica.wire_tiers()
    return replica


def _build_nvme(cache: PrefixCache, settings: CacheSettings,
                registry: CollectorRegistry) -> NvmeTier | None:
    """T3 on the configured path, or None (not configured, or the path cannot hold it: the
    reason is logged and the replica serves without T3, which only costs recompute)."""
    if not settings.nvme_path or not settings.nvme_capacity_bytes:
        return None
    block = cache.layout.bytes_per_block
    if settings.nvme_capacity_bytes < block:
        raise ValueError(f"cache.nvme_capacity_bytes {settings.nvme_capacity_bytes} is smaller "
                         f"than one KV block of this model ({block} bytes)")
    store = NvmeStore.open(NvmeConfig(Path(settings.nvme_path), settings.nvme_capacity_bytes,
                                      block))
    if store is None:
        return None
    tier = NvmeTier(cache, store, mode=settings.nvme_mode,
                    min_sightings=settings.nvme_min_sightings, registry=registry)
    tier.start()
    return tier


