"""`kvfleet bench cache`: the cache core's figures, each measured side by side with its reference.

- lookup latency p50/p99 for 2k/8k/32k-token prompts against an index of 100k+ blocks, warm (a
  prefix looked up recently: chain steps from the memo) and cold (memo emptied: every block hashed),
  next to the same tokens hashed block by block with SHA-256;
- materialize bandwidth T1 -> device for a 2,000-token prefix of a realistic shape, as a ratio to
  one raw torch copy of the same bytes, next to a per-block copy loop (and the TP4 strided gather);
- metadata bytes per indexed block, and per step of the (fixed-size) chain memo;
- the cache's own CPU per request (`bench_request_cpu`): a 2,000-token prompt against an index of
  100k blocks, hit and evicting miss, everything the cache does on the engine's request path,
  next to vLLM's own `KVCacheManager` serving the same request on CPU when vllm imports here;
- token hit rate on a Mooncake trace at 1%/3%/10% of its unique blocks: plain LRU, the shipped
  policy, Belady's offline optimum, the infinite cache, and a frequency ranking told each block's
  whole-trace popularity in advance (the ceiling of frequency ranking; `kvfleet_lab.cache.sim`).

Library code: returns a report, prints nothing (the CLI formats it).
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvfleet_lab.cache.sim import (
    load_mooncake_trace,
    simulate_belady,
    simulate_infinite,
    simulate_kvfleet,
    simulate_lru,
    simulate_popularity_oracle,
    unique_blocks,
)
from kvfleet_runtime.cache import _keys as _keys_module
from kvfleet_runtime.cache._admission import Placement
from kvfleet_runtime.cache._allocator import contiguous_runs
from kvfleet_runtime.cache._block_index import Move, Tier
from kvfleet_runtime.cache._cache import Hit, PrefixCache
from kvfleet_runtime.cache._config import CacheTuning, KVLayout
from kvfleet_runtime.cache._keys import (
    BLOCK_SIZE,
    CacheKey,
    ChainMemo,
    block_hashes,
    iter_block_hashes,
    token_bytes,
    usable_tokens,
)
from kvfleet_runtime.cache._manager import CacheManager, StorePlan
from kvfleet_runtime.cache._pool import TensorPool, execute_moves

__all__ = [
    "SECTIONS",
    "CacheBenchReport",
    "HitRateRow",
    "LookupLatency",
    "MaterializeBandwidth",
    "RequestCpu",
    "bench_hit_rates",
    "bench_lookup",
    "bench_materialize",
    "bench_metadata",
    "bench_request_cpu",
    "run_cache_bench",
]

BENCH_KEY = CacheKey("bench", "bench-model", "sha256:" + "1" * 64, "float16", "rope", "attn")
LLAMA3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
"""A realistic shape for a CPU run (128 KiB/token); 70B GQA-8 is 80 layers (320 KiB/token)."""


@dataclass(slots=True)
class LookupLatency:
    prompt_tokens: int
    num_index_blocks: int
    p50_us: float
    """A prompt this replica looked up recently (a hot prefix): chain steps from the memo."""
    p99_us: float
    cold_p50_us: float
    """The same lookup with the chain memo emptied first: every block is hashed."""
    cold_p99_us: float
    plain_p50_us: float
    """The same lookup in a cache without a memo (`hash_memo_entries=0`)."""
    plain_p99_us: float
    sha256_p50_us: float
    sha256_p99_us: float


@dataclass(slots=True)
class MaterializeBandwidth:
    prefix_tokens: int
    num_bytes: int
    layout: str
    device: str
    raw_copy_s: float
    materialize_s: float
    """A T1 hit copied into a fresh device tensor, one copy per run (TP1)."""
    promote_s: float
    """The T1 -> T0 pool transfer of a promotion (one copy per run)."""
    per_block_s: float
    """The same bytes moved by a copy per block, K and V."""
    tp4_gather_s: float
    """Rank 0 of TP4: a quarter of the bytes, as a strided gather."""
    num_runs: int

    @property
    def materialize_ratio(self) -> float:
        return self.raw_copy_s / self.materialize_s

    @property
    def promote_ratio(self) -> float:
        return self.raw_copy_s / self.promote_s

    @property
    def per_block_ratio(self) -> float:
        return self.raw_copy_s / self.per_block_s

    @property
    def tp4_ratio(self) -> float:
        return self.raw_copy_s / 4 / self.tp4_gather_s


@dataclass(slots=True)
class HitRateRow:
    capacity_fraction: float
    capacity_blocks: int
    lru: float
    kvfleet: float
    belady: float
    infinite: float
    popularity_oracle: float
    """A frequency ranking told every block's whole-trace request count in advance: the ceiling of
    ranking by frequency (`sim.simulate_popularity_oracle`)."""
    kvfleet_request_rate: float
    lru_request_rate: float
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def kvfleet_vs_lru(self) -> float:
        return self.kvfleet / self.lru if self.lru else float("inf")


@dataclass(slots=True)
class RequestCpu:
    """Seconds of CPU per request (medians over interleaved rounds, one process, one core)."""

    prompt_tokens: int
    num_index_blocks: int
    num_requests: int
    """Timed requests per figure (rounds x reps)."""
    request_cpu_hit_s: float
    """kvfleet: a full hit (all but the block holding the last prompt token) of a hot prompt."""
    request_cpu_miss_s: float
    """kvfleet: a prompt seen for the first time, the pool full (its blocks are evicted for it)."""
    vllm_request_cpu_hit_s: float | None = None
    vllm_request_cpu_miss_s: float | None = None
    vllm_version: str | None = None
    vllm_absent_reason: str | None = None
    """Why vLLM's pair is missing (vllm does not import in this interpreter)."""

    @property
    def hit_ratio(self) -> float | None:
        v = self.vllm_request_cpu_hit_s
        return self.request_cpu_hit_s / v if v else None

    @property
    def miss_ratio(self) -> float | None:
        v = self.vllm_request_cpu_miss_s
        return self.request_cpu_miss_s / v if v else None


@dataclass(slots=True)
class CacheBenchReport:
    lookup: list[LookupLatency]
    request_cpu: RequestCpu | None
    materialize: MaterializeBandwidth | None
    metadata_bytes_per_block: float
    metadata_num_blocks: int
    memo_bytes_per_step: float
    memo_max_steps: int
    hit_rates: list[HitRateRow]
    trace: str
    num_trace_requests: int
    num_trace_unique_blocks: int
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.request_cpu is not None:
            r = self.request_cpu
            data.update(
                request_cpu_hit_s=r.request_cpu_hit_s,
                request_cpu_miss_s=r.request_cpu_miss_s,
                request_cpu_hit_vs_vllm=r.hit_ratio,
                request_cpu_miss_vs_vllm=r.miss_ratio,
            )
            if r.vllm_request_cpu_hit_s is not None:
                data.update(
                    vllm_request_cpu_hit_s=r.vllm_request_cpu_hit_s,
                    vllm_request_cpu_miss_s=r.vllm_request_cpu_miss_s,
                )
        if self.materialize is not None:
            m = self.materialize
            data["materialize"].update(
                materialize_ratio=m.materialize_ratio,
                promote_ratio=m.promote_ratio,
                per_block_ratio=m.per_block_ratio,
                tp4_ratio=m.tp4_ratio,
            )
        for row, raw in zip(self.hit_rates, data["hit_rates"], strict=True):
            raw["kvfleet_vs_lru"] = row.kvfleet_vs_lru
        return data


def _percentiles_us(samples_ns: Sequence[int]) -> tuple[float, float]:
    ordered = sorted(samples_ns)
    p50 = statistics.median(ordered) / 1e3
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] / 1e3
    return p50, p99


def _sha256_chain(token_ids: Sequence[int]) -> bytes:
    data = token_bytes(token_ids)
    prev = b""
    for i in range(0, len(data) - 63, 64):
        prev = hashlib.sha256(prev + data[i : i + 64]).digest()
    return prev


def bench_lookup(
    *,
    num_index_blocks: int = 100_000,
    prompt_tokens: Sequence[int] = (2000, 8000, 32000),
    reps: int = 200,
    seed: int = 0,
) -> list[LookupLatency]:
    """Full-hit lookups (hash, walk, take refs), against a filled index: warm (the prompt's steps
    in the chain memo), cold (memo emptied first) and in a cache without a memo."""
    rng = random.Random(seed)
    longest = max(prompt_tokens)
    blocks_per_prompt = longest // BLOCK_SIZE
    num_prompts = max(1, -(-num_index_blocks // blocks_per_prompt))
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16")
    config = CacheTuning(num_t0_blocks=num_prompts * blocks_per_prompt)
    prompts = [[rng.randrange(128_000) for _ in range(longest)] for _ in range(num_prompts)]

    def filled(config: CacheTuning) -> PrefixCache:
        cache = PrefixCache(config, tiny, clock=time.monotonic)
        for prompt in prompts:  # index metadata only: lookups never touch the tensors
            plan = StorePlan(BENCH_KEY, block_hashes(BENCH_KEY, prompt), 0, 0, Placement.REUSED, 0)
            cache._manager.finish_commit(cache._manager.commit(plan))
        return cache

    cache = filled(config)
    plain = filled(replace(config, hash_memo_entries=0))
    manager: CacheManager = cache._manager
    memo = manager._memo
    assert memo is not None, "the default config has a chain memo"

    def timed_lookup(on: PrefixCache, query: list[int], out: list[int]) -> None:
        t0 = time.perf_counter_ns()
        hit = on.lookup(BENCH_KEY, query)
        out.append(time.perf_counter_ns() - t0)
        assert isinstance(hit, Hit) and hit.matched_tokens == len(query) // BLOCK_SIZE * BLOCK_SIZE
        on.release(hit)

    results = []
    for n in prompt_tokens:
        query = prompts[0][:n]
        warm: list[int] = []
        cold: list[int] = []
        no_memo: list[int] = []
        sha: list[int] = []
        for _ in range(reps):
            timed_lookup(cache, query, warm)
            memo.clear()
            timed_lookup(cache, query, cold)
            timed_lookup(plain, query, no_memo)
            t0 = time.perf_counter_ns()
            _sha256_chain(query)
            sha.append(time.perf_counter_ns() - t0)
        results.append(
            LookupLatency(
                n,
                len(manager._index),
                *_percentiles_us(warm),
                *_percentiles_us(cold),
                *_percentiles_us(no_memo),
                *_percentiles_us(sha),
            )
        )
    return results


def bench_memo_bytes_per_step(*, num_steps: int = 65_536) -> float:
    """Bytes a full `ChainMemo` holds per remembered step (keys, digests, dict slots)."""
    rng = random.Random(2)
    tokens = [rng.randrange(128_000) for _ in range(num_steps * BLOCK_SIZE)]
    memo = ChainMemo(2 * num_steps)  # room for every step in the young generation

    def remember_all() -> None:
        for _ in iter_block_hashes(BENCH_KEY, tokens, memo=memo, remember=True):
            pass

    return _bytes_grown_by(remember_all, _keys_module.__file__) / len(memo)


def _bytes_grown_by(run: Callable[[], None], files: str) -> int:
    """Bytes still held after `run` that code in `files` (a glob) allocated. Only the measured
    code's own allocations count: in a busy process (a test run, a replica) other threads
    allocate while `run` runs, and the process total would bill their bytes to it."""
    own = (tracemalloc.Filter(True, files),)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(own)
    run()
    gc.collect()
    after = tracemalloc.take_snapshot().filter_traces(own)
    tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename"))


def _best_s(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    """Median wall time of `reps` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_materialize(
    *,
    layout: KVLayout = LLAMA3_8B,
    prefix_tokens: int = 2000,
    device: str = "cpu",
    reps: int = 5,
) -> MaterializeBandwidth:
    dev = torch.device(device)
    num_blocks = prefix_tokens // BLOCK_SIZE
    tokens = num_blocks * BLOCK_SIZE
    dtype = getattr(torch, layout.dtype)
    shape = (layout.num_layers, layout.num_kv_heads, tokens, layout.head_dim)
    k = torch.randn(shape).to(dtype)
    v = torch.randn(shape).to(dtype)
    prompt = list(range(tokens))
    config = CacheTuning(
        num_t0_blocks=num_blocks,
        num_t1_blocks=num_blocks,
        admit_min_sightings=1,
        hot_min_sightings=10**6,
    )
    cache = PrefixCache(config, layout, clock=time.monotonic, device=dev)
    cache.store(BENCH_KEY, prompt, k, v)
    cache.drain_store_queue()
    hit = cache.lookup(BENCH_KEY, prompt)
    assert isinstance(hit, Hit) and hit.tier is Tier.T1 and hit.matched_tokens == tokens
    path = hit._path
    t1_pool, t0_pool = cache._pools[Tier.T1], cache._pools[Tier.T0]
    assert isinstance(t1_pool, TensorPool) and t0_pool is not None
    t1_ids = [n.block_id for n in path]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    # The raw reference moves the same bytes from host memory (pinned under CUDA, like T1).
    src_k = k.pin_memory() if dev.type == "cuda" else k
    src_v = v.pin_memory() if dev.type == "cuda" else v
    dst_k = torch.empty(shape, dtype=dtype, device=dev)
    dst_v = torch.empty(shape, dtype=dtype, device=dev)

    def raw() -> None:
        dst_k.copy_(src_k)
        dst_v.copy_(src_v)

    out_k, out_v = torch.empty_like(dst_k), torch.empty_like(dst_v)
    everything = slice(None)

    def materialize() -> None:
        # What `materialize` does for a T1 hit when T0 has no room: one copy per run into the
        # fresh device tensor (the T1 blocks stay where they are, so every rep is identical).
        t1_pool.read_into(out_k, out_v, t1_ids, list(range(num_blocks)), everything)

    moves = [Move(Tier.T1, src, Tier.T0, dst) for dst, src in enumerate(t1_ids)]

    def promote() -> None:
        execute_moves(cache._pools, moves)

    def per_block() -> None:
        ok = out_k.view(*out_k.shape[:2], num_blocks, BLOCK_SIZE, out_k.shape[-1])
        ov = out_v.view(*out_v.shape[:2], num_blocks, BLOCK_SIZE, out_v.shape[-1])
        for i, b in enumerate(t1_ids):
            ok[:, :, i : i + 1].copy_(t1_pool.blocks(t1_pool.k, b, 1))
            ov[:, :, i : i + 1].copy_(t1_pool.blocks(t1_pool.v, b, 1))

    quarter = (layout.num_layers, layout.num_kv_heads // 4, tokens, layout.head_dim)
    q_k = torch.empty(quarter, dtype=dtype, device=dev)
    q_v = torch.empty(quarter, dtype=dtype, device=dev)

    def tp4() -> None:
        t1_pool.read_into(q_k, q_v, t1_ids, list(range(num_blocks)), slice(0, None, 4))

    figures = {
        name: _best_s(fn, reps, sync)
        for name, fn in (
            ("raw", raw),
            ("materialize", materialize),
            ("promote", promote),
            ("per_block", per_block),
            ("tp4", tp4),
        )
    }
    # The facade path itself, once, as a check that it moves the same bytes correctly.
    got_k, _ = cache.materialize(hit)
    assert torch.equal(got_k.cpu(), k)
    cache.release(hit)

    return MaterializeBandwidth(
        prefix_tokens=tokens,
        num_bytes=2 * k.numel() * k.element_size(),
        layout=f"{layout.num_layers}L x {layout.num_kv_heads} kv heads x {layout.head_dim} "
        f"{layout.dtype}",
        device=str(dev),
        raw_copy_s=figures["raw"],
        materialize_s=figures["materialize"],
        promote_s=figures["promote"],
        per_block_s=figures["per_block"],
        tp4_gather_s=figures["tp4"],
        num_runs=len(contiguous_runs(t1_ids)),
    )


_TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16")
"""The request path's CPU does not depend on the KV's shape: T0 holds one element per token."""


class _KvfleetServer:
    """The engine's request path through the cache, without a model: prepare the prefix (lookup,
    share the hit's T0 blocks, take the rest, copy what is not in T0), store the prompt's full
    blocks where they are (the store's plan, its ghosts, adoption, events), give the blocks
    back and release."""

    def __init__(self, num_blocks: int) -> None:
        self.cache = PrefixCache(CacheTuning(num_t0_blocks=num_blocks), _TINY, clock=time.monotonic)
        kv = self.cache.device_kv
        assert kv is not None
        self.kv = kv
        self.num_events = 0
        self.cache.add_listener(self._on_event)  # the fleet tier's hint publisher listens here

    def _on_event(self, event: object) -> None:
        self.num_events += 1

    def serve(self, tokens: list[int]) -> int:
        """One request; returns the prompt tokens whose KV came from the cache."""
        cache, kv = self.cache, self.kv
        prefix = cache.prepare(BENCH_KEY, tokens, kv)
        fresh = kv.take(-(-len(tokens) // BLOCK_SIZE) - len(prefix.table))
        assert fresh is not None, "the bench pool is never short of evictable blocks"
        table = prefix.table + fresh
        cached = cache.fill(prefix, table)
        cache.finish(prefix, tokens, table)
        kv.give_back(table)
        return cached


class _VllmServer:
    """vLLM's own `KVCacheManager` (one full-attention group, prefix caching on, SHA-256 block
    hashes: its defaults) serving the same request as its scheduler drives it: the request's
    block hashes, `get_computed_blocks`, `allocate_slots` (which caches the full blocks), and
    `free` at the end."""

    def __init__(self, num_blocks: int, max_model_len: int) -> None:
        import torch as vllm_torch
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.request import Request

        from vllm import SamplingParams

        init_none_hash(sha256)
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=vllm_torch.float16
        )
        config = KVCacheConfig(
            num_blocks=num_blocks + 1,  # vLLM keeps one as its null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE, enable_caching=True,
        )
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._params = SamplingParams(max_tokens=1)
        self._request = Request
        self._ids = itertools.count()

    def make(self, tokens: list[int]) -> Any:
        """A request as the engine core receives it, before it is hashed (outside the timing)."""
        return self._request(f"r{next(self._ids)}", tokens, self._params, None)

    def serve(self, request: Any) -> int:
        manager = self.manager
        request.block_hashes.extend(self._hasher(request))
        blocks, num_computed, _ = manager.get_computed_blocks(request)
        allocated = manager.allocate_slots(
            request, request.num_tokens - num_computed, num_computed, blocks
        )
        assert allocated is not None, "the bench pool is never short of evictable blocks"
        manager.free(request)
        return int(num_computed)


def _vllm_server(num_blocks: int, max_model_len: int) -> tuple[_VllmServer | None, str, str]:
    try:
        import vllm
    except Exception as exc:  # vllm missing, or its torch does not load here
        reason = f"{exc.__class__.__name__}: {exc}"
        return None, "", f"vllm does not import in this interpreter ({reason})"
    return _VllmServer(num_blocks, max_model_len), str(vllm.__version__), ""


def _timed_rounds(
    ours: _KvfleetServer,
    theirs: _VllmServer | None,
    hot: list[int],
    prompt: Callable[[], list[int]],
    expected_hit: int,
    rounds: int,
    reps: int,
) -> dict[str, list[int]]:
    """Interleaved rounds: the hot prompt's hits, then fresh prompts' misses, each request
    timed on its own, kvfleet then vLLM on the same tokens. Timed in this thread's CPU time, not
    wall time: on a shared box a request that is descheduled midway would otherwise be charged
    the other processes' time (a long request more often than a short one, so loaded-box ratios
    drifted from 2.7x to 50x)."""
    samples: dict[str, list[int]] = {"hit": [], "miss": [], "vllm_hit": [], "vllm_miss": []}
    clock = time.thread_time_ns
    for _ in range(rounds):
        # Untimed: (re)store the hot prompt, which the last round's misses may have evicted.
        ours.serve(hot)
        if theirs is not None:
            theirs.serve(theirs.make(hot))
        for _ in range(reps):
            t0 = clock()
            got = ours.serve(hot)
            samples["hit"].append(clock() - t0)
            assert got == expected_hit, f"kvfleet: a hit of {got} tokens, not {expected_hit}"
            if theirs is not None:
                request = theirs.make(hot)
                t0 = clock()
                got = theirs.serve(request)
                samples["vllm_hit"].append(clock() - t0)
                assert got == expected_hit, f"vLLM: a hit of {got} tokens, not {expected_hit}"
        for _ in range(reps):
            tokens = prompt()
            t0 = clock()
            got = ours.serve(tokens)
            samples["miss"].append(clock() - t0)
            assert got == 0, "kvfleet: a fresh prompt hit"
            if theirs is not None:
                request = theirs.make(tokens)
                t0 = clock()
                got = theirs.serve(request)
                samples["vllm_miss"].append(clock() - t0)
                assert got == 0, "vLLM: a fresh prompt hit"
    return samples


def bench_request_cpu(
    *,
    num_index_blocks: int = 100_000,
    prompt_tokens: int = 2000,
    rounds: int = 3,
    reps: int = 400,
    seed: int = 0,
    with_vllm: bool = True,
) -> RequestCpu:
    """The cache's CPU per request against a full index of `num_index_blocks` blocks, hit (a hot
    prompt) and miss (a prompt never seen, the pool full of other prompts: its blocks are
    evicted for it), beside vLLM's `KVCacheManager` serving the same requests in the same
    process. Rounds interleave the two (hit, then miss), so load on the box hits both alike;
    the figures are medians over every timed request."""
    rng = random.Random(seed)
    blocks_per_prompt = -(-prompt_tokens // BLOCK_SIZE)
    if num_index_blocks < 2 * blocks_per_prompt or prompt_tokens <= BLOCK_SIZE:
        raise ValueError(
            f"request-cpu: an index of {num_index_blocks} blocks must hold two prompts of "
            f"{prompt_tokens} tokens (more than one block each)"
        )

    def prompt() -> list[int]:
        return [rng.randrange(128_000) for _ in range(prompt_tokens)]

    ours = _KvfleetServer(num_index_blocks)
    theirs, version, absent = (
        _vllm_server(num_index_blocks, 4 * prompt_tokens) if with_vllm else (None, "", "")
    )
    if not with_vllm:
        absent = "not asked for"
    # Fill both pools with other prompts, as a replica that has been serving for a while.
    for _ in range(num_index_blocks // blocks_per_prompt):
        tokens = prompt()
        ours.serve(tokens)
        if theirs is not None:
            theirs.serve(theirs.make(tokens))
    hot = prompt()
    expected_hit = usable_tokens(prompt_tokens)
    # As vLLM's engine core does once it is up (`freeze_gc_heap`): the collector stops
    # scanning what start-up and the fill left (torch, vllm, both pools), so a collection's
    # cost is not charged to whichever side happened to trigger it.
    gc.collect()
    gc.freeze()
    try:
        samples = _timed_rounds(ours, theirs, hot, prompt, expected_hit, rounds, reps)
    finally:
        gc.unfreeze()
    assert ours.num_events > 0, "no block event reached the listener"

    def median_s(name: str) -> float:
        return statistics.median(samples[name]) / 1e9

    return RequestCpu(
        prompt_tokens=prompt_tokens,
        num_index_blocks=len(ours.cache._manager._index),
        num_requests=rounds * reps,
        request_cpu_hit_s=median_s("hit"),
        request_cpu_miss_s=median_s("miss"),
        vllm_request_cpu_hit_s=median_s("vllm_hit") if theirs is not None else None,
        vllm_request_cpu_miss_s=median_s("vllm_miss") if theirs is not None else None,
        vllm_version=version or None,
        vllm_absent_reason=absent or None,
    )


def bench_metadata(*, num_blocks: int = 100_000, chain_blocks: int = 125) -> float:
    """Bytes the index holds per block (nodes, hashes, maps, heaps), excluding fixed-size parts
    (the sketch, the slot allocators) that do not grow with the number of indexed blocks."""
    rng = random.Random(1)
    chains = []
    for _ in range(-(-num_blocks // chain_blocks)):
        tokens = [rng.randrange(128_000) for _ in range(chain_blocks * BLOCK_SIZE)]
        chains.append(block_hashes(BENCH_KEY, tokens))
    config = CacheTuning(num_t0_blocks=len(chains) * chain_blocks)
    gc.collect()
    manager = CacheManager(config, bytes_per_block=1, clock=time.monotonic)

    def index_all() -> None:
        for hashes in chains:
            manager.finish_commit(
                manager.commit(StorePlan(BENCH_KEY, hashes, 0, 0, Placement.REUSED, 0))
            )

    cache_files = str(Path(_keys_module.__file__).parent / "*")
    return _bytes_grown_by(index_all, cache_files) / len(manager._index)


def bench_hit_rates(
    trace: Path,
    *,
    fractions: Sequence[float] = (0.01, 0.03, 0.10),
    max_requests: int | None = None,
) -> tuple[list[HitRateRow], int, int]:
    requests = load_mooncake_trace(trace, max_requests=max_requests)
    unique = unique_blocks(requests)
    infinite = simulate_infinite(requests).token_hit_rate
    rows = []
    for fraction in fractions:
        capacity = max(1, int(unique * fraction))
        seconds: dict[str, float] = {}
        results = {}
        for name, fn in (
            ("lru", simulate_lru),
            ("kvfleet", simulate_kvfleet),
            ("belady", simulate_belady),
            ("popularity_oracle", simulate_popularity_oracle),
        ):
            t0 = time.perf_counter()
            results[name] = fn(requests, capacity)
            seconds[name] = time.perf_counter() - t0
        rows.append(
            HitRateRow(
                capacity_fraction=fraction,
                capacity_blocks=capacity,
                lru=results["lru"].token_hit_rate,
                kvfleet=results["kvfleet"].token_hit_rate,
                belady=results["belady"].token_hit_rate,
                infinite=infinite,
                popularity_oracle=results["popularity_oracle"].token_hit_rate,
                kvfleet_request_rate=results["kvfleet"].request_hit_rate,
                lru_request_rate=results["lru"].request_hit_rate,
                seconds=seconds,
            )
        )
    return rows, len(requests), unique


SECTIONS = ("lookup", "request-cpu", "materialize", "metadata", "hit-rates")
"""What `run_cache_bench` can measure; a quick check of one figure names only its section."""


def run_cache_bench(
    *,
    trace: Path,
    max_requests: int | None,
    device: str = "cpu",
    lookup_reps: int = 200,
    materialize_reps: int = 5,
    request_cpu_rounds: int = 3,
    request_cpu_reps: int = 400,
    layout: KVLayout = LLAMA3_8B,
    index_blocks: int = 100_000,
    fractions: Sequence[float] = (0.01, 0.03, 0.10),
    sections: Sequence[str] = SECTIONS,
) -> CacheBenchReport:
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    wanted = set(sections)
    if "hit-rates" in wanted and not trace.is_file():
        raise ValueError(f"trace file not found: {trace} (a Mooncake-format JSONL file)")
    start = time.perf_counter()
    lookup = bench_lookup(num_index_blocks=index_blocks, reps=lookup_reps) if (
        "lookup" in wanted) else []
    request_cpu = bench_request_cpu(
        num_index_blocks=index_blocks, rounds=request_cpu_rounds, reps=request_cpu_reps
    ) if "request-cpu" in wanted else None
    materialize = bench_materialize(layout=layout, device=device, reps=materialize_reps) if (
        "materialize" in wanted) else None
    memo_steps = CacheTuning(num_t0_blocks=1).hash_memo_entries
    if "metadata" in wanted:
        per_block = bench_metadata(num_blocks=index_blocks)
        per_step = bench_memo_bytes_per_step(num_steps=memo_steps)
    else:
        per_block = per_step = 0.0
    if "hit-rates" in wanted:
        rows, num_requests, unique = bench_hit_rates(
            trace, fractions=fractions, max_requests=max_requests
        )
    else:
        rows, num_requests, unique = [], 0, 0
    return CacheBenchReport(
        lookup=lookup,
        request_cpu=request_cpu,
        materialize=materialize,
        metadata_bytes_per_block=per_block,
        metadata_num_blocks=index_blocks,
        memo_bytes_per_step=per_step,
        memo_max_steps=memo_steps,
        hit_rates=rows,
        trace=str(trace),
        num_trace_requests=num_requests,
        num_trace_unique_blocks=unique,
        seconds=time.perf_counter() - start,
    )
