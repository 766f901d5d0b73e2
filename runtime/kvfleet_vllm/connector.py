"""`KvfleetConnector`: kvfleet's host tier, key, admission and stats inside vLLM 0.33, as a KV
connector (`KVConnectorBase_V1`). vLLM's own GPU prefix cache stays T0.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvfleetConnector",
        "kv_connector_module_path": "kvfleet_vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvfleet.host_pool_path": "/dev/shm/kvfleet-host-pool",
                                      "kvfleet.num_host_blocks": 65536, "kvfleet.model_id": "m"}}'

Scheduler side (engine-core process): `ConnectorIndex` answers `get_num_new_matched_tokens`
from kvfleet's index, beyond what vLLM's prefix cache matched, in whole vLLM blocks; admission
decides which prompt blocks are saved when a prefill completes. Worker side (one per TP rank):
copies between the shared host pool and vLLM's paged KV (`_copy`). The plans travel in
`KvfleetConnectorMetadata`; each step's `KvfleetWorkerMetadata` comes back with the step id and
the saves that failed, and only then do saved blocks become visible and loads drop their
references. A load that cannot be served is reported in `get_block_ids_with_load_errors`, and
vLLM recomputes those blocks. Every load and save is synchronous within its step: loads in
`start_load_kv`, before the forward reads the blocks; saves in `wait_for_save`, after the
forward wrote every layer and before the step returns (one copy per run for all layers).

T2 (`kvfleet.peer_port`, `_peer.PeerService`): the scheduler side also serves the host pool to
peers, publishes it to the hint index, and fetches what a peer holds beyond the host pool's match
(`get_num_new_matched_tokens` answers None while the fetch runs, bounded by `kvfleet.peer_wait_s`).

Requests the key cannot describe bypass the connector entirely (no load, no store): LoRA
adapters, multimodal inputs and prompt embeddings change the KV without changing the tokens.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvfleet_runtime.auth import SaltRefused
from kvfleet_runtime.cache import BLOCK_SIZE, CacheConfig, CacheKey, CacheStats, KVLayout
from kvfleet_runtime.fleet import FleetSettings
from kvfleet_vllm._copy import (
    HostPool,
    LayerViews,
    Piece,
    RankHeads,
    load_blocks,
    plan_pieces,
    save_blocks,
    stack_layers,
    view_positions,
)
from kvfleet_vllm._keys import ModelKey, TenantSalts, model_key
from kvfleet_vllm._options import DEFAULT_HOST_POOL_PATH, EXTRA_KEYS, PREFIX
from kvfleet_vllm._peer import DEFAULT_WAIT_S, PeerService
from kvfleet_vllm._plan import ConnectorIndex, LoadPlan, SavePlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KvfleetConnector",
    "KvfleetConnectorMetadata",
    "KvfleetConnectorStats",
    "KvfleetPromMetrics",
    "KvfleetWorkerMetadata",
]

logger = logging.getLogger(__name__)

_PREFIX = PREFIX
_EXTRA_KEYS = EXTRA_KEYS


@dataclass(slots=True)
class KvfleetConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one step: loads and saves with each request's vLLM block table."""

    step_id: int
    loads: list[tuple[LoadPlan, tuple[int, ...]]] = field(default_factory=list)
    saves: list[tuple[SavePlan, tuple[int, ...]]] = field(default_factory=list)


@dataclass(slots=True)
class KvfleetWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, one step: which step finished, and which saves failed on any rank."""

    step_id: int
    failed_store_ids: set[int] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvfleetWorkerMetadata) and other.step_id == self.step_id
        return KvfleetWorkerMetadata(self.step_id, self.failed_store_ids | other.failed_store_ids)


_STAT_COUNTERS = (
    ("lookup_tokens", "Prompt tokens of requests the connector looked up (once per request)."),
    ("matched_tokens", "Tokens loaded from kvfleet's host pool beyond vLLM's own prefix hit."),
    ("stored_blocks", "Blocks admission let into the host pool."),
    ("fetched_blocks", "Blocks fetched from peers (T2) into the host pool, verified."),
)
"""Exported as `kvfleet_cache_<name>_total{tenant}`: the names a kvfleet replica's cache exports
for the first two, so the operator's hit-rate query reads a vLLM replica's kvfleet share too."""


class KvfleetConnectorStats(KVConnectorStats):
    """Per-tenant counts since the last report: `data = {"tenants": {tenant: {name: n}}}`, and
    `data["salt_refused"] = {reason: n}` when requests bypassed the connector for their salt."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {"tenants": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        tenants = self.data.setdefault("tenants", {})
        for tenant, counts in other.data.get("tenants", {}).items():
            mine = tenants.setdefault(tenant, {})
            for name, n in counts.items():
                mine[name] = mine.get(name, 0) + n
        if other.data.get("salt_refused"):
            refused = self.data.setdefault("salt_refused", {})
            for reason, n in other.data["salt_refused"].items():
                refused[reason] = refused.get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        totals: dict[str, int | float] = {name: 0 for name, _ in _STAT_COUNTERS}
        for counts in self.data.get("tenants", {}).values():
            for name, n in counts.items():
                totals[name] = totals.get(name, 0) + n
        return totals

    def is_empty(self) -> bool:
        return not self.data.get("tenants") and not self.data.get("salt_refused")


class KvfleetPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"kvfleet_cache_{name}", documentation=doc,
                                    labelnames=[*labelnames, "tenant"])
            for name, doc in _STAT_COUNTERS
        }
        self._salt_refused = self._counter_cls(
            name="kvfleet_vllm_salt_refused_requests",
            documentation="Requests that bypassed the connector because their cache_salt did not "
                          "verify (reason: missing, malformed, forged).",
            labelnames=[*labelnames, "reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for tenant, counts in transfer_stats_data.get("tenants", {}).items():
            for name, counter in self._counters.items():
                # All of a tenant's series start at its first report: a series born with a
                # value shows Prometheus no increase, so rate() would drop its first matches.
                child = counter.labels(*engine, tenant)
                if counts.get(name):
                    child.inc(counts[name])
        for reason, n in transfer_stats_data.get("salt_refused", {}).items():
            self._salt_refused.labels(*engine, reason).inc(n)


def _layout(vllm_config: VllmConfig) -> KVLayout:
    mc = vllm_config.model_config
    if mc.use_mla:
        raise ValueError(f"the kvfleet connector does not support MLA models ({mc.model})")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ValueError(f"the kvfleet connector copies KV exactly in the model dtype; "
                         f"--kv-cache-dtype {cache_dtype!r} is not supported (use auto)")
    dtype = str(mc.dtype).removeprefix("torch.")
    return KVLayout(mc.get_num_layers(vllm_config.parallel_config), mc.get_total_num_kv_heads(),
                    mc.get_head_size(), dtype)


class KvfleetConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(k for k in extra if k.removeprefix(_PREFIX) not in _EXTRA_KEYS
                         or not k.startswith(_PREFIX))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; the kvfleet "
                             f"connector reads {sorted(_PREFIX + k for k in _EXTRA_KEYS)}")
        self.block_size: int = vllm_config.cache_config.block_size
        if self.block_size % BLOCK_SIZE:
            raise ValueError(f"--block-size must be a multiple of {BLOCK_SIZE} for the kvfleet "
                             f"connector, got {self.block_size}")
        self.layout = _layout(vllm_config)
        num_slots = int(extra.get(_PREFIX + "num_host_blocks", 0))
        if num_slots <= 0:
            raise ValueError(f"{_PREFIX}num_host_blocks must be > 0, got {num_slots}")
        pool_path = Path(str(extra.get(_PREFIX + "host_pool_path", DEFAULT_HOST_POOL_PATH)))
        self.salts = TenantSalts.from_extra(extra, _PREFIX)
        # scheduler side
        self.index: ConnectorIndex | None = None
        self.peers: PeerService | None = None
        """T2 (`kvfleet.peer_port` set and the fleet settings present), else None."""
        self._model_key: ModelKey | None = None
        self._requests: dict[str, Request] = {}
        self._local_tokens: dict[str, int] = {}
        self._stored: set[str] = set()
        self._pending_meta: KvfleetConnectorMetadata | None = None
        self._kv_manager: KVCacheManager | None = None
        # worker side
        self.pool: HostPool | None = None
        self.heads: RankHeads | None = None
        self._layers: dict[str, tuple[int, torch.Tensor]] = {}
        self._targets: list[LayerViews] = []
        self._saved_layers: dict[int, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._failed_stores: set[int] = set()
        self._step_id = -1
        if role == KVConnectorRole.SCHEDULER:
            mc = vllm_config.model_config
            backend = vllm_config.attention_config.backend
            self._model_key = model_key(
                Path(mc.model),
                model_id=str(extra.get(_PREFIX + "model_id", mc.served_model_name)),
                kv_dtype=self.layout.dtype,
                attention_backend=getattr(backend, "name", None) or str(backend or "auto"),
                digest=extra.get(_PREFIX + "weights_digest"),
            )
            defaults = CacheConfig(num_t0_blocks=0, num_t1_blocks=num_slots)
            config = CacheConfig(
                num_t0_blocks=0, num_t1_blocks=num_slots,
                admit_min_sightings=int(extra.get(_PREFIX + "admit_min_sightings",
                                                  defaults.admit_min_sightings)),
                hot_min_sightings=int(extra.get(_PREFIX + "hot_min_sightings",
                                                defaults.hot_min_sightings)))
            self.index = ConnectorIndex(self.layout, num_slots, vllm_block_size=self.block_size,
                                        clock=time.monotonic, config=config)
            self.peers = self._start_peers(extra, pool_path, num_slots)
        else:
            pc = vllm_config.parallel_config
            self.heads = RankHeads.for_rank(self.layout.num_kv_heads, pc.tensor_parallel_size,
                                            self._tp_rank(extra))
            self.pool = HostPool(pool_path, self.layout, num_slots)

    def _start_peers(self, extra: dict[str, Any], pool_path: Path, num_slots: int
                     ) -> PeerService | None:
        """T2 in this (engine-core) process: the peer server, hint publishing and fetches."""
        raw_port = extra.get(_PREFIX + "peer_port")
        if raw_port is None:
            return None
        try:
            port = int(raw_port)
        except (TypeError, ValueError):
            port = -1
        if not 0 <= port < 65536 or isinstance(raw_port, bool):
            raise ValueError(f"{_PREFIX}peer_port must be a TCP port (0-65535), got {raw_port!r}")
        settings = FleetSettings.from_env(os.environ, port=port)
        if settings is None or not settings.secret:
            logger.warning("kvfleet connector: %speer_port is set but %s: T2 is off", _PREFIX,
                           "no fleet settings" if settings is None else "no peer secret")
            return None
        raw_wait = extra.get(_PREFIX + "peer_wait_s", DEFAULT_WAIT_S)
        try:
            wait_s = float(raw_wait)
        except (TypeError, ValueError):
            wait_s = float("nan")
        if not 0 < wait_s <= 60:
            raise ValueError(f"{_PREFIX}peer_wait_s must be seconds in (0, 60], got {raw_wait!r}")
        assert self.index is not None
        service = PeerService(self.index, HostPool(pool_path, self.layout, num_slots), settings,
                              port=port, bind_host=str(extra.get(_PREFIX + "peer_host", "0.0.0.0")),
                              wait_s=wait_s)
        service.start()
        return service

    def shutdown(self) -> None:
        if self.peers is not None:
            self.peers.close()
            self.peers = None

    @staticmethod
    def _tp_rank(extra: dict[str, Any]) -> int:
        if _PREFIX + "tp_rank" in extra:  # a worker built outside a distributed run (tests)
            return int(extra[_PREFIX + "tp_rank"])
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())

    # ==== scheduler side =====================================================================

    @property
    def model_key(self) -> ModelKey:
        assert self._model_key is not None
        return self._model_key

    def key_of(self, request: Request) -> CacheKey | None:
        """The request's cache key, or None when the connector must leave it alone."""
        if (request.lora_request is not None or request.mm_features
                or request.prompt_embeds is not None or request.prompt_token_ids is None):
            return None
        tenant = self.salts.tenant(request.request_id, request.cache_salt)
        return None if isinstance(tenant, SaltRefused) else self.model_key.key(tenant)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.index is not None
        key = self.key_of(request)
        self._local_tokens[request.request_id] = num_computed_tokens
        if key is None:
            return 0, False
        tokens = request.prompt_token_ids or []
        if self.peers is not None and self.peers.poll(request.request_id, key, tokens,
                                                      num_computed_tokens):
            return None, False  # a peer is sending the next blocks: ask again next step
        return self.index.num_matched(key, tokens, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.index is not None
        key = self.key_of(request)
        if key is None:
            return
        self._requests[request.request_id] = request
        local = self._local_tokens.pop(request.request_id, 0)
        plan = self.index.admit(request.request_id, key, request.prompt_token_ids or [], local,
                                num_external_tokens)
        if plan is not None:
            meta = self._meta()
            meta.loads.append((plan, tuple(blocks.get_block_ids()[0])))

    def _meta(self) -> KvfleetConnectorMetadata:
        if self._pending_meta is None:
            self._pending_meta = KvfleetConnectorMetadata(step_id=-1)
        return self._pending_meta

    def _block_table(self, req_id: str) -> tuple[int, ...]:
        assert self._kv_manager is not None, "the scheduler binds its KVCacheManager first"
        return tuple(self._kv_manager.get_block_ids(req_id)[0])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.index is not None
        meta = self._meta()
        self._pending_meta = None
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._stored:
                continue
            if request.num_computed_tokens + num_new < request.num_prompt_tokens:
                continue  # chunked prefill: the prompt's KV is complete in a later step
            self._stored.add(req_id)
            key = self.key_of(request)
            assert key is not None
            plan = self.index.store(req_id, key, request.prompt_token_ids or [])
            if plan is not None:
                meta.saves.append((plan, self._block_table(req_id)))
        meta.step_id = self.index.end_step()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.index is not None
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KvfleetWorkerMetadata):
            self.index.step_done(worker_meta.step_id, worker_meta.failed_store_ids)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self.index is not None
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._local_tokens.pop(req_id, None)
        self._stored.discard(req_id)
        self.index.request_finished(req_id)
        if self.peers is not None:
            self.peers.forget(req_id)
        return False, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.index is None:  # the worker side has nothing to report
            return None
        data: dict[str, Any] = {"tenants": self.index.take_deltas()}
        if refused := self.salts.take_refusals():
            data["salt_refused"] = refused
        return KvfleetConnectorStats(data=data) if data["tenants"] or refused else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvfleetConnectorStats(data=data or {"tenants": {}})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvfleetPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def stats(self, tenant: str | None = None) -> CacheStats:
        assert self.index is not None
        return self.index.stats(tenant)

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        assert self.heads is not None and self.pool is not None
        layout = self.layout
        layers: dict[str, tuple[int, torch.Tensor]] = {}
        for name, view in kv_caches.items():
            index = extract_layer_index(name)
            expected = (self.heads.num_heads, 2 * layout.head_dim)
            if view.dim() != 4 or (view.shape[1], view.shape[3]) != expected:
                raise ValueError(
                    f"kvfleet connector: layer {name} KV view is {tuple(view.shape)}; expected "
                    f"[blocks, {expected[0]} heads, tokens, {expected[1]}] (K and V of "
                    "head_dim each in the last axis)")
            if view.dtype != getattr(torch, layout.dtype):
                raise ValueError(f"kvfleet connector: layer {name} KV is {view.dtype}, the "
                                 f"host pool holds {layout.dtype}")
            tokens = view.shape[2]
            if tokens % BLOCK_SIZE or self.block_size % tokens:
                raise ValueError(f"kvfleet connector: layer {name} has {tokens}-token blocks; "
                                 f"need a multiple of {BLOCK_SIZE} dividing {self.block_size}")
            if not 0 <= index < layout.num_layers:
                raise ValueError(f"kvfleet connector: layer {name} index {index} is outside "
                                 f"[0, {layout.num_layers})")
            layers[name] = (index, view)
        by_index = {i: v for i, v in layers.values()}
        if len(by_index) != layout.num_layers:
            raise ValueError(f"kvfleet connector: {len(layers)} KV layers registered, the model "
                             f"has {layout.num_layers}")
        self._layers = layers
        # One copy per piece for every layer when vLLM's layers share one strided allocation;
        # otherwise one per piece and layer.
        stacked = stack_layers([by_index[i] for i in range(layout.num_layers)])
        self._targets = ([stacked] if stacked is not None
                         else [LayerViews.of(i, by_index[i]) for i in range(layout.num_layers)])
        if any(v.is_cuda for v in by_index.values()) and not self.pool.pin():
            logger.warning("kvfleet connector: could not page-lock the host pool; host -> GPU "
                           "copies go through pageable memory")

    def _pieces(self, chain: tuple[int, ...], table: tuple[int, ...], slots: tuple[int, ...],
                views: LayerViews) -> list[Piece]:
        positions = view_positions(table, chain, vllm_block_size=self.block_size,
                                   view_block_tokens=views.block_tokens)
        return plan_pieces(positions, slots, view_block_tokens=views.block_tokens)

    def _blocks_of(self, chain: tuple[int, ...], table: tuple[int, ...]) -> set[int]:
        per = self.block_size // BLOCK_SIZE
        return {table[j // per] for j in chain}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfleetConnectorMetadata) and self.pool and self.heads
        self._step_id = meta.step_id
        for plan, table in meta.loads:
            if plan.failed:
                self._load_errors |= self._blocks_of(plan.chain_blocks, table)
                continue
            try:
                for views in self._targets:
                    load_blocks(self.pool, views, self.heads,
                                self._pieces(plan.chain_blocks, table, plan.slots, views))
            except Exception:  # any failure degrades to recompute, never to wrong KV
                logger.exception("kvfleet connector: load for %s failed", plan.req_id)
                self._load_errors |= self._blocks_of(plan.chain_blocks, table)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copied every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # The copies wait for wait_for_save (end of the forward, every layer written): then one
        # copy per piece moves all layers at once. A layer's saved blocks are complete prompt
        # blocks, which nothing rewrites before the step ends.
        entry = self._layers.get(layer_name)
        if entry is not None:
            self._saved_layers[entry[0]] = kv_layer

    def wait_for_save(self) -> None:
        saved, self._saved_layers = self._saved_layers, {}
        if not saved:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfleetConnectorMetadata) and self.pool and self.heads
        registered = {index: view for index, view in self._layers.values()}
        if saved.keys() == registered.keys() and all(saved[i] is registered[i] for i in saved):
            targets = self._targets
        else:  # only some layers reported, or other tensors than registered: those, one by one
            targets = [LayerViews.of(i, view) for i, view in sorted(saved.items())]
        for plan, table in meta.saves:
            if plan.store_id in self._failed_stores:
                continue
            try:
                for views in targets:
                    save_blocks(self.pool, views, self.heads,
                                self._pieces(plan.chain_blocks, table, plan.slots, views))
            except Exception:  # the blocks are never served; the request is unaffected
                logger.exception("kvfleet connector: save for %s failed", plan.req_id)
                self._failed_stores.add(plan.store_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._step_id < 0:
            return None
        failed, self._failed_stores = self._failed_stores, set()
        return KvfleetWorkerMetadata(self._step_id, failed)
