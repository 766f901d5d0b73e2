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

(2) Worker side: host pool -> one vLLM-layout layer view per layer (`load_blocks`), scattered
slot/block ids and contiguous runs, against one raw `copy_` of the same number of bytes.

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
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

__all__ = ["BenchReport", "CopyRow", "LookupRow", "main", "run_bench"]


@dataclass(slots=True)
class LookupRow:
    connector: str
    prompt_tokens: int
    case: str  # "hit" | "miss"
    matched_tokens: int
    median_us: float


@dataclass(slots=True)
class CopyRow:
    pattern: str  # "scattered" | "contiguous" | "raw copy"
    num_bytes: int
    median_ms: float
    gb_per_s: float


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
    index = conn.index
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
        key = conn.key_of(reqs.make(tokens))
        assert key is not None
        for _ in range(4):  # admission may want several sightings
            if index.store("seed", key, tokens) is not None:
                break
        index.step_done(index.end_step(), set())
        matched, us = _time_lookups(lookup, partial(reqs.make, tokens), reps)
        rows.append(LookupRow("kvfleet", n, "hit", matched, us))
    return rows


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
            sched._release_step()  # the step region build_connector_meta would close
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
        with sched.manager.lock:
            out = sched.manager.prepare_store(keys, status.req_context)
            assert out is not None, "vLLM's CPU manager refused the store"
            sched.manager.complete_store(keys, status.req_context)
        conn.request_finished(req, [])
        matched, us = _time_lookups(lookup, partial(reqs.make, tokens), reps)
        rows.append(LookupRow("vllm-offloading", n, "hit", matched, us))
    return rows


def _copy_rows(num_blocks: int, num_layers: int, num_heads: int, head_dim: int, reps: int,
               pool_dir: Path) -> tuple[list[CopyRow], dict[str, Any]]:
    import torch

    from kvfleet_runtime.cache import BLOCK_SIZE, KVLayout
    from kvfleet_vllm._copy import HostPool, RankHeads, load_blocks, view_positions

    layout = KVLayout(num_layers=num_layers, num_kv_heads=num_heads, head_dim=head_dim)
    pool = HostPool(pool_dir / "copy-pool", layout, num_blocks)
    pool.k.normal_()
    pool.v.normal_()
    # vLLM's logical per-layer view [blocks, heads, tokens, 2 * head_dim] (NHD, contiguous).
    views = [torch.zeros(num_blocks, num_heads, BLOCK_SIZE, 2 * head_dim, dtype=torch.float16)
             for _ in range(num_layers)]
    heads = RankHeads.for_rank(num_heads, 1, 0)
    n = num_blocks // 2  # half the pool per load, so scattered ids have room to scatter
    num_bytes = n * layout.bytes_per_token * BLOCK_SIZE
    rng = random.Random(2)
    patterns = {
        "contiguous": (list(range(n)), list(range(n))),
        "scattered": (rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)),
    }
    rows = []
    for name, (slots, table) in patterns.items():
        positions = view_positions(table, range(n), vllm_block_size=BLOCK_SIZE,
                                   view_block_tokens=BLOCK_SIZE)

        def load(slots: list[int] = slots, positions: list[tuple[int, int]] = positions) -> None:
            for layer, view in enumerate(views):
                load_blocks(pool, layer, view, heads, positions, slots)

        load()  # warm: page the shared file in; and check what landed, bitwise
        d = head_dim
        for layer in (0, num_layers - 1):
            got = views[layer][torch.tensor(table[:n])]
            want_k = pool.k[layer][:, torch.tensor(slots)].permute(1, 0, 2, 3)
            want_v = pool.v[layer][:, torch.tensor(slots)].permute(1, 0, 2, 3)
            if not (torch.equal(got[..., :d], want_k) and torch.equal(got[..., d:], want_v)):
                raise RuntimeError(f"{name} load of layer {layer} is not the pool's bytes")
        s = _median_s(load, reps)
        rows.append(CopyRow(name, num_bytes, s * 1e3, num_bytes / s / 1e9))
    src = torch.empty(num_bytes, dtype=torch.uint8).random_()
    dst = torch.empty(num_bytes, dtype=torch.uint8)
    dst.copy_(src)
    s = _median_s(lambda: dst.copy_(src), reps)
    rows.append(CopyRow("raw copy", num_bytes, s * 1e3, num_bytes / s / 1e9))
    config = {"copy_blocks_loaded": n, "copy_pool_blocks": num_blocks, "num_layers": num_layers,
              "num_kv_heads": num_heads, "head_dim": head_dim, "dtype": "float16"}
    return rows, config


def run_bench(*, sizes: list[int], lookup_reps: int, copy_blocks: int, copy_layers: int,
              copy_heads: int, copy_head_dim: int, copy_reps: int, threads: int) -> BenchReport:
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
                                                  copy_head_dim, copy_reps, tmp_path)
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
    lines.append(f"host pool -> vLLM-layout views ({raw.num_bytes / 2**20:,.0f} MiB per load, "
                 "median)")
    for r in report.copies:
        lines.append(f"  {r.pattern:<11} {r.median_ms:>9,.2f} ms {r.gb_per_s:>7.2f} GB/s "
                     f"{raw.median_ms / r.median_ms:>6.2f}x of raw")
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
    report = run_bench(sizes=sizes, lookup_reps=args.lookup_reps, copy_blocks=args.copy_blocks,
                       copy_layers=args.copy_layers, copy_heads=args.copy_heads,
                       copy_head_dim=args.copy_head_dim, copy_reps=args.copy_reps,
                       threads=args.threads)
    out = json.dumps(asdict(report), indent=2) if args.as_json else format_report(report)
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
