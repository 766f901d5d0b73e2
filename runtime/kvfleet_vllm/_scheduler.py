"""The connector's scheduler side (vLLM's engine-core process): the requests' cache keys, the
lookups, loads and saves planned on kvfleet's index (`_connector_index.ConnectorIndex`), T2
(`_peer`) and the stats. vLLM's types appear only in annotations: `connector` wraps the plans in
vLLM's metadata classes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfleet_runtime.auth import SaltRefused
from kvfleet_runtime.cache import CacheKey, CacheStats, CacheTuning, KVLayout
from kvfleet_runtime.fleet import FleetSettings
from kvfleet_vllm._connector_index import ConnectorIndex, LoadPlan, SavePlan
from kvfleet_vllm._copy import HostPool
from kvfleet_vllm._keys import ModelKey, TenantSalts, model_key
from kvfleet_vllm._options import PREFIX, ConnectorOptions
from kvfleet_vllm._peer import DEFAULT_WAIT_S, PeerService

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)


class SchedulerSide:
    """Answers vLLM's scheduler: `num_matched` (how many tokens beyond vLLM's own hit the host
    pool, or a peer, will supply), `after_alloc` (the lookup that counts, and the load plan),
    `end_step` (the saves of prompts whose prefill completes), `step_done` (the workers'
    report), `finished`."""

    def __init__(self, opts: ConnectorOptions, layout: KVLayout, *, vllm_block_size: int,
                 model_dir: Path, served_model_name: str, attention_backend: str) -> None:
        self.salts = TenantSalts.load(opts.default_tenant, opts.salt_secret_file)
        self.model_key: ModelKey = model_key(
            model_dir, model_id=opts.model_id or served_model_name, kv_dtype=layout.dtype,
            attention_backend=attention_backend, digest=opts.weights_digest)
        defaults = CacheTuning(num_t0_blocks=0, num_t1_blocks=opts.num_host_blocks)
        config = CacheTuning(
            num_t0_blocks=0, num_t1_blocks=opts.num_host_blocks,
            admit_min_sightings=(defaults.admit_min_sightings if opts.admit_min_sightings is None
                                 else opts.admit_min_sightings),
            hot_min_sightings=(defaults.hot_min_sightings if opts.hot_min_sightings is None
                               else opts.hot_min_sightings))
        self.index = ConnectorIndex(layout, opts.num_host_blocks, vllm_block_size=vllm_block_size,
                                    clock=time.monotonic, config=config)
        self.peers: PeerService | None = _start_peers(opts, self.index, layout)
        """T2 (`kvfleet.peer_port` set and the fleet settings present), else None."""
        self._requests: dict[str, Request] = {}
        self._local_tokens: dict[str, int] = {}
        self._stored: set[str] = set()
        self._kv_manager: KVCacheManager | None = None

    def shutdown(self) -> None:
        if self.peers is not None:
            self.peers.close()
            self.peers = None

    def key_of(self, request: Request) -> CacheKey | None:
        """The request's cache key, or None when the connector must leave it alone."""
        if (request.lora_request is not None or request.mm_features
                or request.prompt_embeds is not None or request.prompt_token_ids is None):
            return None
        tenant = self.salts.tenant(request.request_id, request.cache_salt)
        return None if isinstance(tenant, SaltRefused) else self.model_key.key(tenant)

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_manager = kv_cache_manager

    def num_matched(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens the host pool supplies beyond vLLM's own `num_computed_tokens`; None while a
        peer sends the next blocks (vLLM asks again next step)."""
        key = self.key_of(request)
        self._local_tokens[request.request_id] = num_computed_tokens
        if key is None:
            return 0
        tokens = request.prompt_token_ids or []
        if self.peers is not None and self.peers.poll(request.request_id, key, tokens,
                                                      num_computed_tokens):
            return None
        return self.index.num_matched(key, tokens, num_computed_tokens)

    def after_alloc(self, request: Request, num_external_tokens: int) -> LoadPlan | None:
        key = self.key_of(request)
        if key is None:
            return None
        self._requests[request.request_id] = request
        local = self._local_tokens.pop(request.request_id, 0)
        return self.index.admit(request.request_id, key, request.prompt_token_ids or [], local,
                                num_external_tokens)

    def end_step(self, num_scheduled_tokens: dict[str, int]
                 ) -> tuple[int, list[tuple[SavePlan, tuple[int, ...]]]]:
        """This step's id, and the saves (with each request's block table) of the prompts
        whose prefill completes in it."""
        saves = []
        for req_id, num_new in num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._stored:
                continue
            if request.num_computed_tokens + num_new < request.num_prompt_tokens:
                continue  # chunked prefill: the prompt's KV is complete in a later step
            self._stored.add(req_id)
            key = self.key_of(request)
            assert key is not None  # admitted by after_alloc under a key
            plan = self.index.store(req_id, key, request.prompt_token_ids or [])
            if plan is not None:
                saves.append((plan, self._block_table(req_id)))
        return self.index.end_step(), saves

    def _block_table(self, req_id: str) -> tuple[int, ...]:
        assert self._kv_manager is not None, "the scheduler binds its KVCacheManager first"
        return tuple(self._kv_manager.get_block_ids(req_id)[0])

    def step_done(self, step_id: int, failed_store_ids: set[int]) -> None:
        self.index.step_done(step_id, failed_store_ids)

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._local_tokens.pop(req_id, None)
        self._stored.discard(req_id)
        self.index.request_finished(req_id)
        if self.peers is not None:
            self.peers.forget(req_id)

    def take_stats(self) -> dict[str, Any] | None:
        """Per-tenant deltas and salt refusals since the last call (None: nothing new)."""
        data: dict[str, Any] = {"tenants": self.index.take_deltas()}
        if refused := self.salts.take_refusals():
            data["salt_refused"] = refused
        return data if data["tenants"] or refused else None

    def stats(self, tenant: str | None = None) -> CacheStats:
        return self.index.stats(tenant)


def _start_peers(opts: ConnectorOptions, index: ConnectorIndex, layout: KVLayout
                 ) -> PeerService | None:
    """T2 in this (engine-core) process: the peer server, hint publishing and fetches."""
    if opts.peer_port is None:
        return None
    settings = FleetSettings.from_env(os.environ, port=opts.peer_port)
    if settings is None or not settings.secret:
        logger.warning("kvfleet connector: %speer_port is set but %s: T2 is off", PREFIX,
                       "no fleet settings" if settings is None else "no peer secret")
        return None
    service = PeerService(index, HostPool(opts.host_pool_path, layout, opts.num_host_blocks),
                          settings, port=opts.peer_port, bind_host=opts.peer_host,
                          wait_s=DEFAULT_WAIT_S if opts.peer_wait_s is None else opts.peer_wait_s)
    service.start()
    return service
