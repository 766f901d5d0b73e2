"""Builders for driving vLLM's real scheduler and KV views on CPU (the pattern of vLLM's own
connector unit tests: the model runner's output is constructed by the test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvfleet_vllm.connector import KvfleetConnector
from vllm import SamplingParams

EOS = 2
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
_model_configs: dict[Path, ModelConfig] = {}


def vllm_config(model: Path, pool_path: Path, *, block_size: int = 16, tp: int = 1,
                num_host_blocks: int = 64, **extra: Any) -> VllmConfig:
    if model not in _model_configs:  # parsing a model config costs seconds; share it
        _model_configs[model] = ModelConfig(model=str(model), skip_tokenizer_init=True,
                                            dtype="float16", seed=0)
    extra_config = {"kvfleet.host_pool_path": str(pool_path),
                    "kvfleet.num_host_blocks": num_host_blocks, "kvfleet.model_id": "tiny",
                    **{f"kvfleet.{k}": v for k, v in extra.items()}}
    return VllmConfig(
        model_config=_model_configs[model],
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvfleetConnector", kv_connector_module_path="kvfleet_vllm.connector",
            kv_role="kv_both", kv_connector_extra_config=extra_config,
            kv_load_failure_policy="recompute"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(vc: VllmConfig, num_blocks: int) -> KVCacheConfig:
    mc = vc.model_config
    spec = FullAttentionSpec(block_size=vc.cache_config.block_size,
                             num_kv_heads=mc.get_total_num_kv_heads(),
                             head_size=mc.get_head_size(), dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def scheduler(vc: VllmConfig, num_blocks: int = 64) -> Scheduler:
    vc.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vc, kv_cache_config=kv_cache_config(vc, num_blocks),
                     log_stats=True, structured_output_manager=StructuredOutputManager(vc),
                     block_size=vc.cache_config.block_size)


def connector_of(s: Scheduler) -> KvfleetConnector:
    assert isinstance(s.connector, KvfleetConnector)
    return s.connector


def worker(vc: VllmConfig, tp_rank: int = 0) -> KvfleetConnector:
    vc.kv_transfer_config.kv_connector_extra_config["kvfleet.tp_rank"] = tp_rank
    try:
        return KvfleetConnector(vc, KVConnectorRole.WORKER,
                                kv_cache_config(vc, vc.cache_config.num_gpu_blocks or 64))
    finally:
        del vc.kv_transfer_config.kv_connector_extra_config["kvfleet.tp_rank"]


_hasher_ready = False


def request(req_id: str, tokens: list[int], *, salt: str | None = "tenant-a",
            max_tokens: int = 2, block_size: int = 16) -> Request:
    global _hasher_ready
    if not _hasher_ready:
        init_none_hash(sha256)
        _hasher_ready = True
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=params,
                   pooling_params=None, mm_features=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def runner_output(reqs: list[Request], worker_meta: Any = None,
                  invalid_block_ids: set[int] | None = None, token: int = 7
                  ) -> ModelRunnerOutput:
    ids = [r.request_id for r in reqs]
    kv_out = None
    if worker_meta is not None or invalid_block_ids:
        kv_out = KVConnectorOutput(invalid_block_ids=invalid_block_ids or set(),
                                   kv_connector_worker_meta=worker_meta)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None,
                             kv_connector_output=kv_out)


def layer_views(num_blocks: int, num_heads: int, head_dim: int, block_size: int,
                layout: KVCacheLayout, num_layers: int = 2) -> list[torch.Tensor]:
    """Per-layer `[blocks, heads, block_size, 2 * head_dim]` float16 views of one raw buffer,
    made by vLLM's own `create_kv_cache_views` for `layout` (the strides a backend gets)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_heads,
                             head_size=head_dim, dtype=torch.float16)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.attn" for i in range(num_layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, num_blocks, layout, tensor)


def step(s: Scheduler, workers: list[KvfleetConnector], views: list[list[torch.Tensor]],
         invalid: bool = True) -> tuple[Any, list[Request]]:
    """One engine step: schedule, run every worker's connector on its views, feed the output."""
    out = s.schedule()
    meta = out.kv_connector_metadata
    worker_meta = None
    errors: set[int] = set()
    for w, layer_list in zip(workers, views, strict=True):
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)  # type: ignore[arg-type]
        for name, view in zip(LAYERS, layer_list, strict=True):
            w.save_kv_layer(name, view, None)
        w.wait_for_save()
        errors |= w.get_block_ids_with_load_errors()
        m = w.build_connector_worker_meta()
        worker_meta = m if worker_meta is None else worker_meta.aggregate(m)
        w.clear_connector_metadata()
    reqs = [s.requests[r] for r in out.num_scheduled_tokens]
    outputs = s.update_from_output(out, runner_output(reqs, worker_meta, errors))
    for eco in outputs.values():
        if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
            REPORTED.append(eco.scheduler_stats.kv_connector_stats)
    return out, reqs


REPORTED: list[dict[str, Any]] = []
"""The connector stats payloads the scheduler shipped towards vLLM's frontend, step by step."""
