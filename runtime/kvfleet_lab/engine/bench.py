"""`kvfleet bench replica`: what the prefix cache buys a replica, measured side by side in one run.

1. TTFT of one long prompt (2,000 tokens by default): full prefill (miss) vs a T0 hit vs a T1
   hit, each on its own engine and cache, median of `reps` runs, and the ratios.
2. Throughput on repeated system prompts: the same concurrent workload with and without a cache.
3. The cost of a miss: `lookup` (a miss) + what `store` costs on the request path (gathering the
   prompt's KV and queueing it), as a fraction of the prefill it accompanies; the background copy
   into the pool (`drain_store_queue`) is reported separately because it is off the request path.

In-process (no HTTP), so the figures are the engine's and the cache's, not the server's.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet_runtime.cache import CacheConfig, KVLayout, PrefixCache
from kvfleet_runtime.engine._engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    GenerationRequest,
    TokenEvent,
)
from kvfleet_runtime.engine._sampling import SamplingParams
from kvfleet_runtime.model import (
    LoadedModel,
    ModelArgs,
    PagedKV,
    default_device,
    generate_checkpoint,
    load_checkpoint,
)
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = ["ReplicaBenchReport", "run_replica_bench"]


@dataclass(slots=True)
class ReplicaBenchReport:
    device: str
    model: str
    prompt_tokens: int
    reps: int
    ttft_full_prefill_s: float
    ttft_t0_hit_s: float
    ttft_t1_hit_s: float
    cached_tokens_t0: int
    cached_tokens_t1: int
    workload: str
    throughput_no_cache_tok_s: float
    throughput_cache_tok_s: float
    workload_cached_token_fraction: float
    prefill_s: float
    miss_lookup_s: float
    miss_store_path_s: float
    store_drain_s: float

    @property
    def t0_speedup(self) -> float:
        return self.ttft_full_prefill_s / self.ttft_t0_hit_s

    @property
    def t1_speedup(self) -> float:
        return self.ttft_full_prefill_s / self.ttft_t1_hit_s

    @property
    def throughput_ratio(self) -> float:
        return self.throughput_cache_tok_s / self.throughput_no_cache_tok_s

    @property
    def miss_overhead_fraction(self) -> float:
        return (self.miss_lookup_s + self.miss_store_path_s) / self.prefill_s

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(t0_speedup=self.t0_speedup, t1_speedup=self.t1_speedup,
                   throughput_ratio=self.throughput_ratio,
                   miss_overhead_fraction=self.miss_overhead_fraction)
        return out


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (n,), generator=g).tolist())


def _cache(loaded: LoadedModel, *, t0: int, t1: int) -> PrefixCache:
    a = loaded.args
    return PrefixCache(CacheConfig(num_t0_blocks=t0, num_t1_blocks=t1),
                       KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype=a.dtype),
                       clock=time.monotonic, device=loaded.model.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _ttft(engine: Engine, request: GenerationRequest) -> tuple[float, int]:
    start = time.perf_counter()
    stream = engine.submit(request)
    first: float | None = None
    cached = 0
    async for event in stream:
        if isinstance(event, TokenEvent) and first is None:
            first = time.perf_counter() - start
            cached = event.cached_tokens
    assert first is not None
    await engine.drain_stores()
    return first, cached


async def _ttft_case(loaded: LoadedModel, fields: CacheKeyFields, prompt: tuple[int, ...],
                     cache: PrefixCache | None, reps: int, blocks: int) -> tuple[float, int]:
    engine = Engine(loaded.model, fields, cache=cache,
                    config=EngineConfig(num_kv_blocks=blocks, max_batch_size=4))
    await engine.start()
    try:
        one = SamplingParams(max_tokens=1, temperature=0.0)
        request = GenerationRequest("bench", prompt, one)
        if cache is not None:  # two sightings admit the prompt, then every run is a hit
            for _ in range(2):
                await _ttft(engine, request)
        else:
            await _ttft(engine, request)  # warm-up
        runs = [await _ttft(engine, request) for _ in range(reps)]
    finally:
        await engine.stop()
    return statistics.median(t for t, _ in runs), min(c for _, c in runs)


async def _throughput(loaded: LoadedModel, fields: CacheKeyFields, cache: PrefixCache | None,
                      *, num_systems: int, system_tokens: int, num_requests: int,
                      concurrency: int, max_tokens: int) -> tuple[float, float]:
    engine = Engine(loaded.model, fields, cache=cache,
                    config=EngineConfig(num_kv_blocks=concurrency * (
                        (system_tokens + 64 + max_tokens) // BLOCK_SIZE + 2),
                        max_batch_size=concurrency))
    systems = [_tokens(system_tokens, 1000 + i) for i in range(num_systems)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [GenerationRequest(f"tenant-{i % num_systems}",
                                  systems[i % num_systems] + _tokens(16 + i % 48, 5000 + i),
                                  params) for i in range(num_requests)]
    queue: asyncio.Queue[GenerationRequest] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    generated = 0
    cached = 0

    async def worker() -> None:
        nonlocal generated, cached
        while not queue.empty():
            out, fin = await engine.generate(queue.get_nowait())
            generated += len(out)
            cached += fin.cached_tokens

    await engine.start()
    try:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    finally:
        await engine.stop()
    prompt_total = sum(len(r.token_ids) for r in requests)
    return generated / wall, cached / prompt_total


def _miss_cost(loaded: LoadedModel, fields: CacheKeyFields, prompt: tuple[int, ...],
               reps: int) -> tuple[float, float, float, float]:
    """Medians: prefill, lookup (miss), store on the request path, background drain."""
    model, device = loaded.model, loaded.model.device
    n_blocks = -(-len(prompt) // BLOCK_SIZE)
    kv = PagedKV.allocate(model.args, n_blocks, device=device)
    table = kv.take(n_blocks)
    assert table is not None
    n_full = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    prefill, lookup, store, drain = [], [], [], []

    def timed(fn: Callable[[], Any]) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    for rep in range(reps + 1):
        # A cache with room and admission on first sight: the worst case for the store path.
        a = loaded.args
        cache = PrefixCache(CacheConfig(num_t0_blocks=n_blocks + 1, admit_min_sightings=1),
                            KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype=a.dtype),
                            clock=time.monotonic, device=device)
        key = fields.key(f"miss-{rep}")
        t_lookup = timed(lambda: cache.lookup(key, prompt))  # noqa: B023
        t_prefill = timed(lambda: model.prefill(prompt, 0, table, kv))

        def offer() -> None:
            k, v = kv.gather(table, n_full)
            cache.store(key, prompt[:n_full], k, v)  # noqa: B023

        t_store = timed(offer)
        t_drain = timed(cache.drain_store_queue)
        if rep:  # the first round warms allocators and kernels
            prefill.append(t_prefill)
            lookup.append(t_lookup)
            store.append(t_store)
            drain.append(t_drain)
    med = statistics.median
    return med(prefill), med(lookup), med(store), med(drain)


def run_replica_bench(*, model_dir: Path | None = None, preset: str = "small",
                      prompt_tokens: int = 2000, reps: int = 5,
                      device: torch.device | None = None,
                      num_requests: int = 32, concurrency: int = 8) -> ReplicaBenchReport:
    device = device or default_device()
    model_name = preset if model_dir is None else Path(model_dir).name
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        if model_dir is None:
            model_dir = Path(tmp) / preset
            generate_checkpoint(model_dir, ModelArgs.from_preset(preset), seed=0)
        loaded = load_checkpoint(model_dir, device=device)
    if prompt_tokens + 1 > loaded.args.max_seq_len:
        raise ValueError(f"prompt_tokens {prompt_tokens} does not fit the model's context "
                         f"of {loaded.args.max_seq_len}")
    fields = CacheKeyFields.for_model(loaded, model_name)
    prompt = _tokens(prompt_tokens, 7)
    blocks = prompt_tokens // BLOCK_SIZE + 2
    t_full, _ = asyncio.run(_ttft_case(loaded, fields, prompt, None, reps, blocks))
    t_t0, c_t0 = asyncio.run(_ttft_case(loaded, fields, prompt,
                                        _cache(loaded, t0=blocks, t1=0), reps, blocks))
    # No T0: every hit is copied from the host pool (pinned when CUDA is present).
    t_t1, c_t1 = asyncio.run(_ttft_case(loaded, fields, prompt,
                                        _cache(loaded, t0=0, t1=blocks), reps, blocks))
    system_tokens = min(1000, prompt_tokens)
    workload = dict(num_systems=4, system_tokens=system_tokens, num_requests=num_requests,
                    concurrency=concurrency, max_tokens=16)
    tp_none, _ = asyncio.run(_throughput(loaded, fields, None, **workload))
    cache_blocks = 4 * (system_tokens // BLOCK_SIZE + 8) * 2
    tp_cache, frac = asyncio.run(_throughput(loaded, fields,
                                             _cache(loaded, t0=cache_blocks, t1=cache_blocks),
                                             **workload))
    prefill_s, lookup_s, store_s, drain_s = _miss_cost(loaded, fields, prompt, reps)
    a = loaded.args
    return ReplicaBenchReport(
        device=str(device),
        model=f"{model_name} ({a.n_layers} layers, dim {a.dim}, {a.n_heads}/{a.n_kv_heads} heads)",
        prompt_tokens=prompt_tokens, reps=reps,
        ttft_full_prefill_s=t_full, ttft_t0_hit_s=t_t0, ttft_t1_hit_s=t_t1,
        cached_tokens_t0=c_t0, cached_tokens_t1=c_t1,
        workload=(f"{num_requests} requests, {concurrency} concurrent, 4 system prompts of "
                  f"{system_tokens} tokens + 16-63 unique tokens, 16 output tokens"),
        throughput_no_cache_tok_s=tp_none, throughput_cache_tok_s=tp_cache,
        workload_cached_token_fraction=frac,
        prefill_s=prefill_s, miss_lookup_s=lookup_s, miss_store_path_s=store_s,
        store_drain_s=drain_s,
    )
