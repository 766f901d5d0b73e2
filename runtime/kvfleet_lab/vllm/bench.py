"""`kvfleet bench vllm-connector`: the connector's costs next to vLLM 0.33's own.

(1) Scheduler side, per request: `get_num_new_matched_tokens` of kvfleet's connector and of
vLLM's `OffloadingConnector` (its CPU offloading connector), both built in the SCHEDULER role from
the same `VllmConfig` of a tiny generated checkpoint, for prompts of 2,000 and 32,000 tokens,
on a miss (nothing stored) and on a hit (the prompt's blocks stored through each connector's own
store path first). Timed per request: kvfleet's `get_num_new_matched_tokens` +
`request_finished`; vLLM's `on_new_request` (the scheduler calls it once per request and its
lookup needs it) + `get_num_new_matched_tokens` + `request_finished`.
vLLM hashes a request's blocks when the `Request` is built (its block hasher), kvfleet hashes
inside the lookup (its key carries tenant, weights digest and the rest): Request construction is
outside the timed region on both sides, so kvfleet's figure includes its hashing, vLLM's does not.

(2) Worker side: the connector's copies between the host pool and vLLM's own layer views
(`create_kv_cache_views`, one allocation, in each KV cache layout), loads and saves of scattered
slot/block ids and of contiguous runs, against a raw `copy_` of the same number of bytes timed
between the reps (both see the same load on a shared box).

Run with `"$(scripts/vllm-env.sh)" -m kvfleet_lab.vllm.bench` and PYTHONPATH=runtime:operator:.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

__all__ = ["COPY_LAYOUTS", "BenchReport", "CopyRow", "LookupRow", "main", "run_bench"]

COPY_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM 0.33's `KVCacheLayout` members (named here: this module imports vllm only when it runs)."""


@dataclass(slots=True)
class LookupRow:
    connector: str
    prompt_tokens: int
    case: str  # "hit" | "miss"
    matched_tokens: int
    median_us: float


@dataclass(slots=True)
class CopyRow:
    pattern: str  # "load|save contiguous|scattered" | "raw copy"
    num_bytes: int
    median_ms: float
    gb_per_s: float
    layout: str  # vLLM's KVCacheLayout name ("" for the raw copy)
    num_copies: int  # pieces per load or save (each one copy for all layers)
    x_raw: float  # raw copy time / this time, raw copies interleaved with this row's reps


@dataclass(slots=True)
class BenchReport:
    lookups: list[LookupRow] = field(default_factory=list)
    vllm_offloading_error: str | None = None
    copies: list[CopyRow] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)


def _median_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _checkpoint(path: Path, max_len: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max_len)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)  # transformers' wrapped `.to` confuses mypy
    model.to(torch.float16).save_pretrained(path)


def _model_config(model: Path, max_len: int) -> Any:
    from vllm.config import ModelConfig

    # Parsed once (seconds) and shared: both connectors see the very same model.
    return ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float16", seed=0,
                       max_model_len=max_len)


def _vllm_config(model_config: Any, max_len: int, kv: Any) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_len,
                                         max_model_len=max_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=kv, parallel_config=ParallelConfig(tensor_parallel_size=1),
        device_config=DeviceConfig("cpu"))


def _kv_cache_config(vc: Any, num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = vc.model_config
    spec = FullAttentionSpec(block_size=16, num_kv_heads=mc.get_total_num_kv_heads(),
                             head_size=mc.get_head_size(), dtype=torch.float16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


class _Requests:
    def __init__(self) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(16, sha256)
        self._n = 0

    def make(self, tokens: list[int]) -> Any:
        from vllm.v1.request import Request

        from vllm import SamplingParams

        self._n += 1
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, 2)
        return Request(request_id=f"r{self._n}", prompt_token_ids=tokens,
                       sampling_params=params, pooling_params=None, mm_features=None,
                       cache_salt="tenant-a", block_hasher=self._hasher)


def _time_lookups(lookup: Callable[[Any], int], make: Callable[[], Any], reps: int
                  ) -> tuple[int, float]:
    times = []
    matched = 0
    for _ in range(reps):
        req = make()  # outside the timed region: vLLM hashes the blocks here
        start = time.perf_counter()
        matched = lookup(req)
        times.append(time.perf_counter() - start)
    return matched, statistics.median(times) * 1e6


def _kvfleet_rows(model: Any, max_len: int, sizes: list[int], reps: int, pool_dir: Path,
                  reqs: _Requests) -> list[LookupRow]:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfleet_vllm.connector import KvfleetConnector

    num_slots = sum(sizes) // 16 + 16
    kv = KVTransferConfig(
        kv_connector="KvfleetConnector", kv_connector_module_path="kvfleet_vllm.connector",
        kv_role="kv_both", kv_connector_extra_config={
            "kvfleet.host_pool_path": str(pool_dir / "pool"), "kvfleet.num_host_blocks": num_slots,
            "kvfleet.model_id": "bench", "kvfleet.admit_min_sightings": 1})
    vc = _vllm_config(model, max_len, kv)
    conn = KvfleetConnector(vc, KVConnectorRole.SCHEDULER, _kv_cache_config(vc, 64))
    index = conn.scheduler.index
    assert index is not None
    rows = []
    rng = random.Random(1)
    for n in sizes:
        tokens = [rng.randrange(3, 512) for _ in range(n)]
        other = [rng.randrange(3, 512) for _ in range(n)]

        def lookup(req: Any) -> int:
            got, _ = conn.get_num_new_matched_tokens(req, 0)
            conn.request_finished(req, [])
            return int(got or 0)

        matched, us = _time_lookups(lookup, partial(reqs.make, other), reps)
        rows.append(LookupRow("kvfleet", n, "miss", matched, us))
        # kvfleet's store path, as the scheduler drives it: a store plan, the step's metadata,
        # the workers' completion (nothing fails).
        key = conn.scheduler.key_of(reqs.make(tokens))
        assert key is not None
        for _ in range(4):  # admission may want several sightings
            if index.store("seed", key, tokens) is not None:
                break
        index.step_done(index.end_step(), set())
        matched, us = _time_lookups(lookup, partial(reqs.make, tokens), reps)
        rows.append(LookupRow("kvfleet", n, "hit", matched, us))
    return rows


# vLLM 0.33's offloading scheduler holds its manager's lock from a step's first lookup until
# build_connector_meta (`_release_step` closes that region) and its manager has a `lock`; 0.32's
# has neither (one thread, no region). The only version difference the bench meets.
def _close_step(sched: Any) -> None:
    release = getattr(sched, "_release_step", None)
    if release is not None:
        release()


def _manager_lock(manager: Any) -> AbstractContextManager[Any]:
    lock = getattr(manager, "lock", None)
    return nullcontext() if lock is None else lock


def _vllm_rows(model: Any, max_len: int, sizes: list[int], reps: int, reqs: _Requests
               ) -> list[LookupRow]:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                          kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30})
    vc = _vllm_config(model, max_len, kv)
    conn = OffloadingConnector(vc, KVConnectorRole.SCHEDULER, _kv_cache_config(vc, 64))
    sched = conn.scheduler
    rows = []
    rng = random.Random(1)
    for n in sizes:
        tokens = [rng.randrange(3, 512) for _ in range(n)]
        other = [rng.randrange(3, 512) for _ in range(n)]

        def lookup(req: Any) -> int:
            conn.on_new_request(req)
            got, _ = conn.get_num_new_matched_tokens(req, 0)
            _close_step(sched)
            conn.request_finished(req, [])
            return int(got or 0)

        matched, us = _time_lookups(lookup, partial(reqs.make, other), reps)
        rows.append(LookupRow("vllm-offloading", n, "miss", matched, us))
        # vLLM's store path at its manager: prepare_store, then complete_store (the worker's
        # finished transfer), for the prompt's offload keys.
        req = reqs.make(tokens)
        conn.on_new_request(req)
        status = sched._req_status[req.request_id]
        status.update_offload_keys()
        keys = [k for g in status.group_states for k in g.offload_keys]
        with _manager_lock(sched.manager):
            out = sched.manager.prepare_store(keys, status.req_context)
            assert out is not None, "vLLM's CPU manager refused the store"
            sched.manager.complete_store(keys, status.req_context)
        conn.request_finished(req, [])
        matched, us = _time_lookups(lookup, partial(reqs.make, tokens), reps)
        rows.append(LookupRow("vllm-offloading", n, "hit", matched, us))
    return rows


def _layer_views(num_blocks: int, num_layers: int, num_heads: int, head_dim: int,
                 layout: Any) -> list[Any]:
    """vLLM's own per-layer views of one allocation in `layout` (what a worker registers)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    from kvfleet_runtime.cache import BLOCK_SIZE

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=num_heads, head_size=head_dim,
                             dtype=torch.float16)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = num_layers * num_blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.attn" for i in range(num_layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    return list(create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, num_blocks,
                                      layout, tensor))


def _copy_rows(num_blocks: int, num_layers: int, num_heads: int, head_dim: int, reps: int,
               pool_dir: Path, layouts: list[str]) -> tuple[list[CopyRow], dict[str, Any]]:
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvfleet_runtime.cache import BLOCK_SIZE, KVLayout
    from kvfleet_vllm._copy import (
        HostPool,
        RankHeads,
        load_blocks,
        plan_pieces,
        save_blocks,
        stack_layers,
        view_positions,
    )

    layout = KVLayout(num_layers=num_layers, num_kv_heads=num_heads, head_dim=head_dim)
    pool = HostPool(pool_dir / "copy-pool", layout, num_blocks)
    pool.kv.normal_()
    original = pool.kv.clone()
    heads = RankHeads.for_rank(num_heads, 1, 0)
    n = num_blocks // 2  # half the pool per load, so scattered ids have room to scatter
    num_bytes = n * layout.bytes_per_token * BLOCK_SIZE
    rng = random.Random(2)
    patterns = {
        "contiguous": (list(range(n)), list(range(n))),
        "scattered": (rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)),
    }
    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty(num_bytes, dtype=torch.uint8)
    dst.copy_(src)
    rows: list[CopyRow] = []
    raw_times: list[float] = []
    for layout_name in layouts:
        views = _layer_views(num_blocks, num_layers, num_heads, head_dim,
                             KVCacheLayout[layout_name])
        target = stack_layers(views)  # what the connector registers: one copy per piece
        assert target is not None, "vLLM's views of one allocation stack"
        for name, (slots, table) in patterns.items():
            positions = view_positions(table, range(n), vllm_block_size=BLOCK_SIZE,
                                       view_block_tokens=BLOCK_SIZE)
            pieces = plan_pieces(positions, slots, view_block_tokens=BLOCK_SIZE)
            for direction, copy in (("load", load_blocks), ("save", save_blocks)):
                # a load reads the random pool; a save writes into a zeroed one
                if direction == "load":
                    pool.kv.copy_(original)
                else:
                    pool.kv.zero_()
                copy(pool, target, heads, pieces)  # warm, and check what landed, bitwise
                for layer in (0, num_layers - 1):
                    got = views[layer][torch.tensor(table)]
                    want_k = pool.k[layer][:, torch.tensor(slots)].permute(1, 0, 2, 3)
                    want_v = pool.v[layer][:, torch.tensor(slots)].permute(1, 0, 2, 3)
                    if not (torch.equal(got[..., :head_dim], want_k)
                            and torch.equal(got[..., head_dim:], want_v)):
                        raise RuntimeError(f"{layout_name} {name} {direction} of layer {layer} "
                                           "differs from the pool's bytes")
                times, raws = [], []
                for _ in range(reps):  # raw copies interleaved: both see the same box load
                    start = time.perf_counter()
                    copy(pool, target, heads, pieces)
                    mid = time.perf_counter()
                    dst.copy_(src)
                    times.append(mid - start)
                    raws.append(time.perf_counter() - mid)
                s, raw_s = statistics.median(times), statistics.median(raws)
                raw_times += raws
                rows.append(CopyRow(f"{direction} {name}", num_bytes, s * 1e3,
                                    num_bytes / s / 1e9, layout_name, len(pieces),
                                    raw_s / s))
    raw = statistics.median(raw_times)
    rows.append(CopyRow("raw copy", num_bytes, raw * 1e3, num_bytes / raw / 1e9, "", 1, 1.0))
    config = {"copy_blocks_loaded": n, "copy_pool_blocks": num_blocks, "num_layers": num_layers,
              "num_kv_heads": num_heads, "head_dim": head_dim, "dtype": "float16",
              "layouts": layouts}
    return rows, config


def run_bench(*, sizes: list[int], lookup_reps: int, copy_blocks: int, copy_layers: int,
              copy_heads: int, copy_head_dim: int, copy_reps: int, threads: int,
              copy_layouts: list[str] | None = None) -> BenchReport:
    import torch

    torch.set_num_threads(threads)
    report = BenchReport()
    max_len = max(sizes) + 16
    with tempfile.TemporaryDirectory(prefix="kvfleet-vllm-bench-") as tmp:
        tmp_path = Path(tmp)
        model = tmp_path / "ckpt"
        _checkpoint(model, max_len)
        model_config = _model_config(model, max_len)
        reqs = _Requests()
        report.lookups += _kvfleet_rows(model_config, max_len, sizes, lookup_reps, tmp_path, reqs)
        try:
            report.lookups += _vllm_rows(model_config, max_len, sizes, lookup_reps, reqs)
        except Exception as exc:  # the baseline's failure is a result to show, not a crash
            report.vllm_offloading_error = f"{type(exc).__name__}: {exc}"
        report.copies, report.config = _copy_rows(copy_blocks, copy_layers, copy_heads,
                                                  copy_head_dim, copy_reps, tmp_path,
                                                  copy_layouts or list(COPY_LAYOUTS))
    report.config.update({"prompt_tokens": sizes, "lookup_reps": lookup_reps,
                          "copy_reps": copy_reps, "threads": threads, "vllm_block_size": 16})
    return report


def format_report(report: BenchReport) -> str:
    lines = ["scheduler side: get_num_new_matched_tokens per request (median)",
             f"  {'prompt':>7} {'case':<5} {'kvfleet':>12} {'vllm-offloading':>16} "
             f"{'kvfleet/vllm':>13}  matched (kvfleet / vllm)"]
    by = {(r.connector, r.prompt_tokens, r.case): r for r in report.lookups}
    for n in report.config["prompt_tokens"]:
        for case in ("miss", "hit"):
            k = by[("kvfleet", n, case)]
            v = by.get(("vllm-offloading", n, case))
            vus = f"{v.median_us:,.1f} us" if v else "n/a"
            ratio = f"{k.median_us / v.median_us:.2f}x" if v and v.median_us else "n/a"
            vm = str(v.matched_tokens) if v else "n/a"
            lines.append(f"  {n:>7,} {case:<5} {k.median_us:>9,.1f} us {vus:>16} {ratio:>13}"
                         f"  {k.matched_tokens} / {vm}")
    if report.vllm_offloading_error:
        lines.append(f"  vLLM's OffloadingConnector failed: {report.vllm_offloading_error}")
    raw = next(r for r in report.copies if r.pattern == "raw copy")
    lines.append(f"host pool <-> vLLM-layout views ({raw.num_bytes / 2**20:,.0f} MiB per load "
                 f"or save, median; x raw = against raw copies interleaved with the row's reps)")
    patterns = [p for p in ("load contiguous", "load scattered", "save contiguous",
                            "save scattered") if any(r.pattern == p for r in report.copies)]
    lines.append(f"  {'layout':<6} " + " ".join(f"{p:>22}" for p in patterns))
    cells = {(r.layout, r.pattern): r for r in report.copies}
    for name in report.config.get("layouts", []):
        row = [cells[(name, p)] for p in patterns]
        lines.append(f"  {name:<6} " + " ".join(
            f"{c.gb_per_s:>7.2f} GB/s {c.x_raw:>5.2f}x{c.num_copies:>5}c" for c in row))
    lines.append(f"  raw copy {raw.median_ms:,.2f} ms, {raw.gb_per_s:.2f} GB/s; "
                 "Nc = copies per load or save (each one copy_ for all layers)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet bench vllm-connector")
    parser.add_argument("--sizes", default="2000,32000",
                        help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--lookup-reps", type=int, default=50)
    parser.add_argument("--copy-blocks", type=int, default=512,
                        help="host pool size in 16-token blocks (half is loaded per rep)")
    parser.add_argument("--copy-layers", type=int, default=8)
    parser.add_argument("--copy-heads", type=int, default=8)
    parser.add_argument("--copy-head-dim", type=int, default=128)
    parser.add_argument("--copy-reps", type=int, default=10)
    parser.add_argument("--copy-layouts", default=",".join(COPY_LAYOUTS),
                        help="vLLM KV cache layouts to copy into, comma-separated")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", action="store_true", dest="as_json")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated ints, got {args.sizes!r}")
    if not sizes or min(sizes) < 32:
        parser.error(f"--sizes must be >= 32 tokens each, got {args.sizes!r}")
    for name in ("lookup_reps", "copy_reps", "threads", "copy_layers", "copy_heads",
                 "copy_head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.copy_blocks < 4:
        parser.error(f"--copy-blocks must be >= 4, got {args.copy_blocks}")
    layouts = [x.strip() for x in args.copy_layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in COPY_LAYOUTS]
    if not layouts or unknown:
        parser.error(f"--copy-layouts takes names from {','.join(COPY_LAYOUTS)}, got "
                     f"{args.copy_layouts!r}")
    report = run_bench(sizes=sizes, lookup_reps=args.lookup_reps, copy_blocks=args.copy_blocks,
                       copy_layers=args.copy_layers, copy_heads=args.copy_heads,
                       copy_head_dim=args.copy_head_dim, copy_reps=args.copy_reps,
                       threads=args.threads, copy_layouts=layouts)
    out = json.dumps(asdict(report), indent=2) if args.as_json else format_report(report)
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
