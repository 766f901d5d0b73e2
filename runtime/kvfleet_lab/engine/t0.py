"""T0 as the engine's KV, measured before/after (issue 17 item 2).

Before: the engine's working KV and the cache's T0 are two pools carved out of one fixed KV
budget; the engine's pool is sized for the in-flight load, the rest is T0, and a T0 hit is a copy
from T0 into the engine's blocks. After: one pool of the whole budget; cached prefixes and
in-flight sequences compete for it block by block, and a T0 hit is block ids placed in the
sequence's table. Both run the real engine and cache; "before" is the same code with the two
pools kept apart (`Engine(kv=...)` on a pool that is not the cache's T0, which takes the copy
path), so the difference is the ownership alone.

1. Capacity: fill the cache with distinct prefixes, start an in-flight load (sequences decoding,
   all sharing one system prompt), and count the cached blocks held while it runs.
2. TTFT of a T0 hit on a long prompt: one pool (share) vs two pools (copy), next to the full
   prefill and the prefill of only the unmatched suffix (the physical floor).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache, usable_tokens
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

__all__ = [
    "T0Report", "format_t0_report", "run_t0_bench", "suffix_at_position", "suffix_at_position_s",
]


@dataclass(slots=True)
class T0Report:
    device: str
    model: str
    budget_blocks: int
    load: str
    inflight_blocks_before: int
    """The engine's own pool in the two-pool design: sized for the load's peak."""
    cached_blocks_before: int
    cached_blocks_after: int
    prompt_tokens: int
    reps: int
    ttft_full_prefill_s: float
    suffix_prefill_s: float
    ttft_t0_hit_two_pools_s: float
    ttft_t0_hit_one_pool_s: float

    @property
    def capacity_ratio(self) -> float:
        return self.cached_blocks_after / max(1, self.cached_blocks_before)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["capacity_ratio"] = self.capacity_ratio
        return out


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (n,), generator=g).tolist())


def _layout(loaded: LoadedModel) -> KVLayout:
    a = loaded.args
    return KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype=a.dtype)


def _engines(loaded: LoadedModel, budget: int, engine_blocks: int | None,
             max_batch_size: int) -> tuple[Engine, PrefixCache, PagedKV]:
    """One pool (`engine_blocks` None) or two pools splitting `budget`."""
    fields = CacheKeyFields.for_model(loaded, "bench")
    device = loaded.model.device
    config = EngineConfig(num_kv_blocks=engine_blocks or budget, max_batch_size=max_batch_size)
    if engine_blocks is None:
        kv = PagedKV.allocate(loaded.args, budget, device=device)
        cache = PrefixCache(CacheTuning(num_t0_blocks=budget), _layout(loaded),
                            clock=time.monotonic, device_kv=kv)
    else:
        kv = PagedKV.allocate(loaded.args, engine_blocks, device=device)
        cache = PrefixCache(CacheTuning(num_t0_blocks=budget - engine_blocks), _layout(loaded),
                            clock=time.monotonic, device=device)
    return Engine(loaded.model, fields, cache=cache, config=config, kv=kv), cache, kv


async def _cached_beside_load(loaded: LoadedModel, budget: int, engine_blocks: int | None, *,
                              num_prefixes: int, prefix_tokens: int, system_tokens: int,
                              num_inflight: int, suffix_tokens: int, max_tokens: int) -> int:
    engine, cache, _ = _engines(loaded, budget, engine_blocks, num_inflight)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    await engine.start()
    try:
        for i in range(num_prefixes):  # more distinct prefixes than the budget holds
            await engine.generate(GenerationRequest("t", _tokens(prefix_tokens, 100 + i), one))
            await engine.drain_stores()
        system = _tokens(system_tokens, 1)  # the load's shared prompt, cached last
        await engine.generate(GenerationRequest("t", (*system, 1), one))
        await engine.drain_stores()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        streams = [engine.submit(GenerationRequest("t", system + _tokens(suffix_tokens, 900 + i),
                                                   params)) for i in range(num_inflight)]
        iters = [s.__aiter__() for s in streams]
        for it in iters:  # every sequence of the load is in flight (prefilled, decoding)
            first = await it.__anext__()
            assert isinstance(first, TokenEvent)
        await engine.drain_stores()
        held = cache.stats().tiers[0].num_blocks_used
        for s in streams:
            s.cancel()
        for it in iters:
            async for _ in it:
                pass
    finally:
        await engine.stop()
    return held


async def _ttft(engine: Engine, prompt: tuple[int, ...], reps: int) -> float:
    one = SamplingParams(max_tokens=1, temperature=0.0)
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        async for event in engine.submit(GenerationRequest("t", prompt, one)):
            if isinstance(event, TokenEvent):
                runs.append(time.perf_counter() - start)
        await engine.drain_stores()
    return statistics.median(runs)


async def _ttft_hit(loaded: LoadedModel, prompt: tuple[int, ...], reps: int,
                    two_pools: bool) -> float:
    blocks = len(prompt) // BLOCK_SIZE + 2
    engine, _, _ = _engines(loaded, 2 * blocks if two_pools else blocks,
                            blocks if two_pools else None, 1)
    await engine.start()
    try:
        await _ttft(engine, prompt, 1)  # stored on first sighting; every later run is a hit
        return await _ttft(engine, prompt, reps)
    finally:
        await engine.stop()


def suffix_at_position(loaded: LoadedModel, prompt: Sequence[int], start: int
                       ) -> Callable[[], int]:
    """The physical floor of a hit of `start` tokens, ready to time: a call computes prompt[start:]
    at its own positions with the prefix's KV already resident in its blocks (attending to all
    of it) and picks the first token (greedy, on the host), with no cache call. `start` 0 is the
    full prefill."""
    model = loaded.model
    kv = PagedKV.allocate(loaded.args, -(-len(prompt) // BLOCK_SIZE), device=model.device)
    table = kv.take(kv.num_blocks)
    assert table is not None
    if start:
        model.prefill(prompt[:start], 0, table, kv)
    suffix = prompt[start:]
    return lambda: int(model.prefill(suffix, start, table, kv).argmax())


def suffix_at_position_s(loaded: LoadedModel, prompt: Sequence[int], start: int,
                         reps: int) -> float:
    """`suffix_at_position`'s time: median of `reps` after a warm-up."""
    floor = suffix_at_position(loaded, prompt, start)
    runs = []
    for _ in range(reps + 1):
        if loaded.model.device.type == "cuda":
            torch.cuda.synchronize(loaded.model.device)
        t = time.perf_counter()
        floor()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs[1:])


def run_t0_bench(*, preset: str = "tiny", ttft_preset: str = "small", prompt_tokens: int = 2000,
                 budget_blocks: int = 256, reps: int = 5,
                 device: torch.device | None = None) -> T0Report:
    device = device or default_device()
    with tempfile.TemporaryDirectory(prefix="kvfleet-t0-bench-") as tmp:
        loaded = {}
        for name in {preset, ttft_preset}:
            generate_checkpoint(Path(tmp) / name, ModelArgs.from_preset(name), seed=0)
            loaded[name] = load_checkpoint(Path(tmp) / name, device=device)
    small = loaded[preset]
    load = dict(num_prefixes=48, prefix_tokens=96, system_tokens=128, num_inflight=4,
                suffix_tokens=72, max_tokens=100)
    peak = load["num_inflight"] * -(-(load["system_tokens"] + load["suffix_tokens"]
                                      + load["max_tokens"]) // BLOCK_SIZE)
    before = asyncio.run(_cached_beside_load(small, budget_blocks, peak, **load))
    after = asyncio.run(_cached_beside_load(small, budget_blocks, None, **load))
    big = loaded[ttft_preset]
    prompt = _tokens(prompt_tokens, 7)
    matched = usable_tokens(prompt_tokens)
    a = big.args
    return T0Report(
        device=str(device),
        model=f"capacity: {preset}; TTFT: {ttft_preset} ({a.n_layers} layers, dim {a.dim})",
        budget_blocks=budget_blocks,
        load=(f"{load['num_inflight']} sequences decoding, each a shared {load['system_tokens']}"
              f"-token system prompt + {load['suffix_tokens']} own tokens + up to "
              f"{load['max_tokens']} generated; {load['num_prefixes']} distinct "
              f"{load['prefix_tokens']}-token prefixes offered before"),
        inflight_blocks_before=peak,
        cached_blocks_before=before,
        cached_blocks_after=after,
        prompt_tokens=prompt_tokens,
        reps=reps,
        ttft_full_prefill_s=suffix_at_position_s(big, prompt, 0, reps),
        suffix_prefill_s=suffix_at_position_s(big, prompt, matched, reps),
        ttft_t0_hit_two_pools_s=asyncio.run(_ttft_hit(big, prompt, reps, two_pools=True)),
        ttft_t0_hit_one_pool_s=asyncio.run(_ttft_hit(big, prompt, reps, two_pools=False)),
    )


def format_t0_report(r: T0Report) -> str:
    ms = 1000.0
    return "\n".join([
        f"T0 as the engine's KV on {r.device}, {r.model}",
        f"  KV budget {r.budget_blocks} blocks; load: {r.load}",
        f"  cached blocks beside the load, two pools (engine {r.inflight_blocks_before} + T0 "
        f"{r.budget_blocks - r.inflight_blocks_before})  {r.cached_blocks_before}",
        f"  cached blocks beside the load, one pool                          "
        f"{r.cached_blocks_after}   {r.capacity_ratio:.2f}x",
        f"  {r.prompt_tokens}-token prompt, median of {r.reps}:",
        f"    full prefill (model)              {r.ttft_full_prefill_s * ms:8.1f} ms",
        f"    suffix prefill (the floor)        {r.suffix_prefill_s * ms:8.1f} ms",
        f"    T0 hit TTFT, two pools (copy)     {r.ttft_t0_hit_two_pools_s * ms:8.1f} ms   "
        f"{r.ttft_t0_hit_two_pools_s / r.suffix_prefill_s:.2f}x the floor",
        f"    T0 hit TTFT, one pool (share)     {r.ttft_t0_hit_one_pool_s * ms:8.1f} ms   "
        f"{r.ttft_t0_hit_one_pool_s / r.suffix_prefill_s:.2f}x the floor",
    ])
