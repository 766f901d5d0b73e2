"""`KvfleetConnector`: kvfleet's host tier, key, admission and stats inside vLLM 0.33, as a KV
connector (`KVConnectorBase_V1`). vLLM's own GPU prefix cache stays T0.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvfleetConnector",
        "kv_connector_module_path": "kvfleet_vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvfleet.host_pool_path": "/dev/shm/kvfleet-host-pool",
                                      "kvfleet.num_host_blocks": 65536, "kvfleet.model_id": "m"}}'

vLLM builds one connector class in two roles; this module is the `KVConnectorBase_V1` shell
that gives each method to its role's side, the options parsed once (`_options.ConnectorOptions`)
for both. Scheduler side (engine-core process, `_scheduler.SchedulerSide`): `ConnectorIndex`
answers `get_num_new_matched_tokens` from kvfleet's index, beyond what vLLM's prefix cache
matched, in whole vLLM blocks; admission decides which prompt blocks are saved when a prefill
completes. Worker side (one per TP rank, `_worker.WorkerSide`): copies between the shared host
pool and vLLM's paged KV (`_copy`). A method called in the other role is a RuntimeError.
The plans travel in `KvfleetConnectorMetadata`; each step's `KvfleetWorkerMetadata` comes back
with the step id and the saves that failed, and only then do saved blocks become visible and
loads drop their references. A load that cannot be served is reported in
`get_block_ids_with_load_errors`, and vLLM recomputes those blocks. Every load and save is
synchronous within its step: loads in `start_load_kv`, before the forward reads the blocks;
saves in `wait_for_save`, after the forward wrote every layer and before the step returns (one
copy per run for all layers).

T2 (`kvfleet.peer_port`, `_peer.PeerService`): the scheduler side also serves the host pool to
peers, publishes it to the hint index, and fetches what a peer holds beyond the host pool's match
(`get_num_new_matched_tokens` answers None while the fetch runs, bounded by `kvfleet.peer_wait_s`).

Requests the key cannot describe bypass the connector entirely (no load, no store): LoRA
adapters, multimodal inputs and prompt embeddings change the KV without changing the tokens.
"""

from __future__ import annotations

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

from kvfleet_runtime.cache import BLOCK_SIZE, KVLayout
from kvfleet_vllm._connector_index import LoadPlan, SavePlan
from kvfleet_vllm._options import ConnectorOptions
from kvfleet_vllm._scheduler import SchedulerSide
from kvfleet_vllm._worker import WorkerSide

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
        opts = ConnectorOptions.parse(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size: int = vllm_config.cache_config.block_size
        if self.block_size % BLOCK_SIZE:
            raise ValueError(f"--block-size must be a multiple of {BLOCK_SIZE} for the kvfleet "
                             f"connector, got {self.block_size}")
        self.layout = _layout(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._pending_meta: KvfleetConnectorMetadata | None = None
        if role == KVConnectorRole.SCHEDULER:
            mc = vllm_config.model_config
            backend = vllm_config.attention_config.backend
            self._scheduler = SchedulerSide(
                opts, self.layout, vllm_block_size=self.block_size, model_dir=Path(mc.model),
                served_model_name=str(mc.served_model_name),
                attention_backend=getattr(backend, "name", None) or str(backend or "auto"))
        else:
            self._worker = WorkerSide(
                opts, self.layout, vllm_block_size=self.block_size,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                tp_rank=opts.tp_rank if opts.tp_rank is not None else _tp_rank())

    @property
    def scheduler(self) -> SchedulerSide:
        """The scheduler side (the connector built in vLLM's SCHEDULER role)."""
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method of the kvfleet connector was called "
                               "in the worker role")
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        """The worker side (the connector built in vLLM's WORKER role)."""
        if self._worker is None:
            raise RuntimeError("a worker-side method of the kvfleet connector was called in "
                               "the scheduler role")
        return self._worker

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ==== scheduler side =====================================================================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        # None: a peer is sending the next blocks; vLLM asks again next step
        return self.scheduler.num_matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        plan = self.scheduler.after_alloc(request, num_external_tokens)
        if plan is not None:
            self._meta().loads.append((plan, tuple(blocks.get_block_ids()[0])))

    def _meta(self) -> KvfleetConnectorMetadata:
        if self._pending_meta is None:
            self._pending_meta = KvfleetConnectorMetadata(step_id=-1)
        return self._pending_meta

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self._meta()
        self._pending_meta = None
        meta.step_id, saves = self.scheduler.end_step(scheduler_output.num_scheduled_tokens)
        meta.saves.extend(saves)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KvfleetWorkerMetadata):
            self.scheduler.step_done(worker_meta.step_id, worker_meta.failed_store_ids)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.finished(request.request_id)
        return False, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is None:  # the worker side has nothing to report
            return None
        data = self._scheduler.take_stats()
        return None if data is None else KvfleetConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvfleetConnectorStats(data=data or {"tenants": {}})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvfleetPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.worker.register({name: (extract_layer_index(name), view)
                              for name, view in kv_caches.items()})

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfleetConnectorMetadata)
        self.worker.load(meta.step_id, meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copied every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.worker.layer_written(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvfleetConnectorMetadata)
        self.worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self.worker.take_step_report()
        return None if report is None else KvfleetWorkerMetadata(*report)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
