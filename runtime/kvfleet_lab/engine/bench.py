"""`kvfleet bench replica`: the engine's compute and what the prefix cache buys, side by side.

One run, one checkpoint, one device and thread count; every figure next to its baseline:

1. Full-prefill TTFT (through the engine, no cache) vs transformers' own forward (SDPA) of the same
   checkpoint, at each of `prefill_tokens` (512 / 2,000 / 8,000 by default). Runs alternate
   between the two so a shared machine's load falls on both alike; medians of `reps`.
2. For one `prompt_tokens` prompt: TTFT on a T0 hit and on a T1 hit vs a fresh prefill of only
   the unmatched suffix (a miss of a prompt that is just the suffix) and vs the hit's physical
   floor (`suffix_at_position_s`: the model computing the suffix at its own positions with the
   prefix's KV already resident, no cache call; T0 hit and floor run alternately), and the T1
   copy into the engine's blocks vs one raw copy of the same bytes (alternately too).
3. Decode throughput (generated tokens/s, the prompts' prefill included on both sides) at each
   concurrency, without and with the cache (every prompt a hit), vs transformers' batched
   `generate` of the same prompts. On CUDA also without the decode step's CUDA graphs
   (`decode_graphs="off"`), so the capture's gain is measured beside it.
4. The deterministic mode's price: its full-prefill TTFT and its throughput beside the fast path's.
5. Cached blocks that fit beside an in-flight load at a fixed KV budget, with T0 the engine's KV
   (the engine's layout since issue 17 item 2: an in-flight hit's prefix is the cached blocks
   themselves) and with T0 a second pool (before: that prefix held twice): the layouts'
   arithmetic; `kvfleet_lab.engine.t0` measures the same by running both.
6. The cost of a miss: `lookup` + the store's request-path work as a fraction of the prefill; the
   background copy into the pool separately.

In-process (no HTTP), so the figures are the engine's and the cache's, not the server's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet_lab.engine.t0 import suffix_at_position
from kvfleet_runtime.cache import CacheTuning, Hit, KVLayout, PrefixCache
from kvfleet_runtime.engine._engine import (
    CacheKeyFields,
    DecodeGraphMode,
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

__all__ = ["DecodeFigures", "PrefillFigures", "ReplicaBenchReport", "run_replica_bench"]

DECODE_PROMPT_TOKENS = 64
"""Prompt length of the decode workload: short, so the figure is mostly decode."""


@dataclass(slots=True)
class PrefillFigures:
    tokens: int
    ttft_full_prefill_s: float
    transformers_prefill_s: float

    @property
    def ratio(self) -> float:
        """kvfleet over transformers (target <= 1.2)."""
        return self.ttft_full_prefill_s / self.transformers_prefill_s


@dataclass(slots=True)
class DecodeFigures:
    concurrency: int
    decode_tok_s: float
    decode_cache_tok_s: float
    transformers_decode_tok_s: float
    decode_uncaptured_tok_s: float | None = None
    """On CUDA: `decode_tok_s` without the CUDA graphs (None elsewhere: nothing is captured)."""

    @property
    def ratio(self) -> float:
        """kvfleet (no cache) over transformers' generate."""
        return self.decode_tok_s / self.transformers_decode_tok_s

    @property
    def graphs_speedup(self) -> float | None:
        """Captured over uncaptured decode throughput (CUDA only)."""
        if self.decode_uncaptured_tok_s is None:
            return None
        return self.decode_tok_s / self.decode_uncaptured_tok_s


@dataclass(slots=True)
class ReplicaBenchReport:
    device: str
    model: str
    attn_impl: str
    cpu_threads: int
    max_tokens_per_step: int
    reps: int
    prefill: list[PrefillFigures]
    prompt_tokens: int
    ttft_full_prefill_s: float
    transformers_prefill_s: float
    suffix_prefill_s: float
    """A miss of a prompt that is just the unmatched suffix (its tokens at positions 0..)."""
    suffix_at_position_s: float
    """The hit's physical floor: the model computing the unmatched suffix at its own positions,
    the prefix's KV already resident in its blocks, no cache call (`t0.suffix_at_position`),
    timed run by run beside the T0 hit."""
    ttft_t0_hit_s: float
    ttft_t1_hit_s: float
    cached_tokens_t0: int
    cached_tokens_t1: int
    t1_copy_s: float
    raw_copy_s: float
    t1_copy_bytes: int
    decode: list[DecodeFigures]
    decode_new_tokens: int
    deterministic_ttft_s: float
    deterministic_concurrency: int
    fast_tok_s: float
    deterministic_tok_s: float
    kv_budget_blocks: int
    inflight_requests: int
    inflight_blocks: int
    inflight_prefix_blocks: int
    prefill_s: float
    miss_lookup_s: float
    miss_store_path_s: float
    store_drain_s: float

    @property
    def t0_vs_suffix(self) -> float:
        return self.ttft_t0_hit_s / self.suffix_prefill_s

    @property
    def t0_vs_suffix_at_position(self) -> float:
        """The T0 hit's TTFT over its physical floor (target <= 1.1)."""
        return self.ttft_t0_hit_s / self.suffix_at_position_s

    @property
    def t1_vs_suffix(self) -> float:
        return self.ttft_t1_hit_s / self.suffix_prefill_s

    @property
    def t1_copy_vs_raw(self) -> float:
        """Bandwidth of the T1 copy path over a raw copy's (target >= 0.8)."""
        return self.raw_copy_s / self.t1_copy_s

    @property
    def cached_blocks_doubled(self) -> int:
        """T0 a second pool: the engine's blocks hold every in-flight token, prefixes included."""
        return max(0, self.kv_budget_blocks - self.inflight_blocks)

    @property
    def cached_blocks_shared(self) -> int:
        """T0 the engine's KV: an in-flight hit's prefix blocks are cached blocks."""
        return max(0, self.kv_budget_blocks - self.inflight_blocks + self.inflight_prefix_blocks)

    @property
    def deterministic_ttft_price(self) -> float:
        return self.deterministic_ttft_s / self.ttft_full_prefill_s

    @property
    def deterministic_tok_s_price(self) -> float:
        return self.fast_tok_s / self.deterministic_tok_s

    @property
    def miss_overhead_fraction(self) -> float:
        return (self.miss_lookup_s + self.miss_store_path_s) / self.prefill_s

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["prefill"] = [asdict(p) | {"ratio": p.ratio} for p in self.prefill]
        out["decode"] = [asdict(d) | {"ratio": d.ratio, "graphs_speedup": d.graphs_speedup}
                         for d in self.decode]
        for name in ("t0_vs_suffix", "t0_vs_suffix_at_position", "t1_vs_suffix",
                     "t1_copy_vs_raw", "cached_blocks_doubled", "cached_blocks_shared",
                     "deterministic_ttft_price", "deterministic_tok_s_price",
                     "miss_overhead_fraction"):
            out[name] = getattr(self, name)
        return out


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (n,), generator=g).tolist())


def _cache(loaded: LoadedModel, *, t0: int, t1: int) -> PrefixCache:
    a = loaded.args
    return PrefixCache(CacheTuning(num_t0_blocks=t0, num_t1_blocks=t1, admit_min_sightings=1),
                       KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype=a.dtype),
                       clock=time.monotonic, device=loaded.model.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class _Bench:
    """One loaded checkpoint in both implementations, and the engines the cases need."""

    def __init__(self, loaded: LoadedModel, hf: Any, model_name: str, budget: int) -> None:
        self.loaded, self.hf, self.budget = loaded, hf, budget
        self.device = loaded.model.device
        self.fields = CacheKeyFields.for_model(loaded, model_name)
        self.det_fields = CacheKeyFields.for_model(loaded, model_name, deterministic=True)

    def engine(self, cache: PrefixCache | None, *, blocks: int, batch: int = 4,
               deterministic: bool = False, graphs: DecodeGraphMode = "auto") -> Engine:
        return Engine(self.loaded.model, self.det_fields if deterministic else self.fields,
                      cache=cache, config=EngineConfig(
                          num_kv_blocks=blocks + (graphs != "off"),  # + the padding block
                          max_batch_size=batch,
                          max_tokens_per_step=max(self.budget, batch + BLOCK_SIZE),
                          deterministic=deterministic, decode_graphs=graphs))

    def hf_prefill(self, prompt: Sequence[int]) -> None:
        ids = torch.tensor([list(prompt)], device=self.device)
        with torch.inference_mode():
            self.hf(ids, logits_to_keep=1)

    def hf_generate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> None:
        ids = torch.tensor([list(p) for p in prompts], device=self.device)
        with torch.inference_mode():
            self.hf.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)


async def _ttft(engine: Engine, request: GenerationRequest) -> tuple[float, int]:
    start = time.perf_counter()
    first: float | None = None
    cached = 0
    async for event in engine.submit(request):
        if isinstance(event, TokenEvent) and first is None:
            first = time.perf_counter() - start
            cached = event.cached_tokens
    assert first is not None
    await engine.drain_stores()
    return first, cached


async def _with(engine: Engine, body: Callable[[Engine], Any]) -> Any:
    await engine.start()
    try:
        return await body(engine)
    finally:
        await engine.stop()


def _one(prompt: Sequence[int], tenant: str = "bench") -> GenerationRequest:
    return GenerationRequest(tenant, tuple(prompt), SamplingParams(max_tokens=1, temperature=0.0))


def _prefill_vs_transformers(b: _Bench, lengths: Sequence[int], reps: int
                             ) -> list[PrefillFigures]:
    out = []
    for n in lengths:
        prompt = _tokens(n, 7)

        async def body(engine: Engine, prompt: tuple[int, ...] = prompt
                       ) -> tuple[list[float], list[float]]:
            await _ttft(engine, _one(prompt))  # warm-up, both sides
            b.hf_prefill(prompt)
            ours, theirs = [], []
            for _ in range(reps):  # alternate, so load falls on both alike
                ours.append((await _ttft(engine, _one(prompt)))[0])
                theirs.append(_timed(b.device, lambda: b.hf_prefill(prompt)))
            return ours, theirs

        ours, theirs = asyncio.run(_with(b.engine(None, blocks=n // BLOCK_SIZE + 2), body))
        out.append(PrefillFigures(n, statistics.median(ours), statistics.median(theirs)))
    return out


def _hit_ttft(b: _Bench, prompt: tuple[int, ...], cache: PrefixCache, reps: int
              ) -> tuple[float, int]:
    async def body(engine: Engine) -> list[tuple[float, int]]:
        await _ttft(engine, _one(prompt))  # the miss that stores the prompt
        await _ttft(engine, _one(prompt))  # warm-up hit
        return [await _ttft(engine, _one(prompt)) for _ in range(reps)]

    runs = asyncio.run(_with(b.engine(cache, blocks=len(prompt) // BLOCK_SIZE + 2), body))
    return statistics.median(t for t, _ in runs), min(c for _, c in runs)


def _t0_hit_beside_floor(b: _Bench, prompt: tuple[int, ...], reps: int
                         ) -> tuple[float, int, float]:
    """The T0 hit's TTFT and its physical floor (`suffix_at_position`: the suffix over the
    prefix's resident KV, no engine, no cache call), run by run alternately so that load on the
    box falls on both alike: (hit median, cached tokens, floor median)."""
    cache = _cache(b.loaded, t0=len(prompt) // BLOCK_SIZE + 2, t1=0)

    async def body(engine: Engine) -> tuple[list[tuple[float, int]], list[float]]:
        await _ttft(engine, _one(prompt))  # the miss that stores the prompt
        _, cached = await _ttft(engine, _one(prompt))  # warm-up hit
        floor = suffix_at_position(b.loaded, prompt, cached)
        _timed(b.device, floor)  # warm-up
        hits, floors = [], []
        for _ in range(reps):
            hits.append(await _ttft(engine, _one(prompt)))
            floors.append(_timed(b.device, floor))
        return hits, floors

    hits, floors = asyncio.run(_with(b.engine(cache, blocks=len(prompt) // BLOCK_SIZE + 2), body))
    return (statistics.median(t for t, _ in hits), min(c for _, c in hits),
            statistics.median(floors))


def _miss_ttft(b: _Bench, prompt: tuple[int, ...], reps: int, *, deterministic: bool = False
               ) -> float:
    async def body(engine: Engine) -> list[float]:
        await _ttft(engine, _one(prompt))
        return [(await _ttft(engine, _one(prompt)))[0] for _ in range(reps)]

    engine = b.engine(None, blocks=len(prompt) // BLOCK_SIZE + 2, deterministic=deterministic)
    return float(statistics.median(asyncio.run(_with(engine, body))))


def _t1_copy(b: _Bench, prompt: tuple[int, ...], reps: int) -> tuple[float, float, int]:
    """The T1 hit's copy into the engine's blocks (`PrefixCache.fill`, the engine's path) vs one
    raw copy of the same bytes."""
    n_blocks = len(prompt) // BLOCK_SIZE
    n_full = n_blocks * BLOCK_SIZE
    cache = _cache(b.loaded, t0=0, t1=n_blocks + 1)
    model = b.loaded.model
    kv = PagedKV.allocate(model.args, n_blocks + 1, device=b.device)
    table = kv.take(n_blocks + 1)
    assert table is not None
    model.prefill(prompt, 0, table, kv)
    k, v = kv.gather(table, n_full)
    key = b.fields.key("copy")
    cache.store(key, prompt[:n_full], k.clone(), v.clone())
    cache.drain_store_queue()
    # One token past the full blocks: every full block is usable (`usable_tokens`), so `fill`
    # copies all of them.
    prefix = cache.prepare(key, (*prompt[:n_full], 0), kv)
    assert isinstance(prefix.hit, Hit) and prefix.num_blocks == n_blocks and not prefix.table
    non_blocking = b.device.type == "cuda"

    def path() -> None:  # the engine's T1 hit: one copy per run into the sequence's blocks
        cache.fill(prefix, table)

    nbytes = 2 * k.numel() * k.element_size()
    # The same bytes, really there: an untouched host buffer reads as the kernel's one zero
    # page (cache-hot), which flattered the raw copy.
    src = torch.cat([k.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)]).cpu()
    if non_blocking:
        src = src.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=b.device)
    ours, raw = [], []
    for _ in range(reps + 1):  # alternate, so load falls on both alike; the first warms up
        ours.append(_timed(b.device, path))
        raw.append(_timed(b.device, lambda: dst.copy_(src, non_blocking=non_blocking)))
    ours, raw = ours[1:], raw[1:]
    cache.finish(prefix)
    return statistics.median(ours), statistics.median(raw), nbytes


def _decode(b: _Bench, concurrency: int, new_tokens: int, reps: int, *, cache: bool,
            deterministic: bool = False, graphs: DecodeGraphMode = "auto") -> float:
    prompts = [_tokens(DECODE_PROMPT_TOKENS, 9000 + i) for i in range(concurrency)]
    blocks = concurrency * ((DECODE_PROMPT_TOKENS + new_tokens) // BLOCK_SIZE + 2)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pc = _cache(b.loaded, t0=blocks, t1=0) if cache else None

    async def round_(engine: Engine) -> float:
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(GenerationRequest("bench", p, params))
                                         for p in prompts))
        wall = time.perf_counter() - start
        await engine.drain_stores()
        return sum(len(out) for out, _ in results) / wall

    async def body(engine: Engine) -> list[float]:
        await round_(engine)  # warm-up; with the cache, it also stores every prompt
        return [await round_(engine) for _ in range(reps)]

    engine = b.engine(pc, blocks=blocks, batch=concurrency, deterministic=deterministic,
                      graphs=graphs)
    return float(statistics.median(asyncio.run(_with(engine, body))))


def _hf_decode(b: _Bench, concurrency: int, new_tokens: int, reps: int) -> float:
    prompts = [_tokens(DECODE_PROMPT_TOKENS, 9000 + i) for i in range(concurrency)]
    b.hf_generate(prompts, new_tokens)
    walls = [_timed(b.device, lambda: b.hf_generate(prompts, new_tokens)) for _ in range(reps)]
    return concurrency * new_tokens / statistics.median(walls)


def _miss_cost(b: _Bench, prompt: tuple[int, ...], reps: int
               ) -> tuple[float, float, float, float]:
    """Medians: prefill, lookup (miss), store on the request path, background drain."""
    model, device = b.loaded.model, b.device
    n_blocks = -(-len(prompt) // BLOCK_SIZE)
    kv = PagedKV.allocate(model.args, n_blocks, device=device)
    table = kv.take(n_blocks)
    assert table is not None
    n_full = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    prefill, lookup, store, drain = [], [], [], []
    for rep in range(reps + 1):
        # A cache with room and admission on first sight: the worst case for the store path.
        cache = _cache(b.loaded, t0=n_blocks + 1, t1=0)
        key = b.fields.key(f"miss-{rep}")
        t_lookup = _timed(device, lambda: cache.lookup(key, prompt))  # noqa: B023
        t_prefill = _timed(device, lambda: model.prefill(prompt, 0, table, kv))

        def offer() -> None:
            k, v = kv.gather(table, n_full)
            cache.store(key, prompt[:n_full], k, v)  # noqa: B023

        t_store = _timed(device, offer)
        t_drain = _timed(device, cache.drain_store_queue)
        if rep:  # the first round warms allocators and kernels
            prefill.append(t_prefill)
            lookup.append(t_lookup)
            store.append(t_store)
            drain.append(t_drain)
    med = statistics.median
    return med(prefill), med(lookup), med(store), med(drain)


def _load_transformers(model_dir: Path, loaded: LoadedModel) -> Any:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # --json
    dtype = loaded.model.embed_tokens.weight.dtype
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=dtype)
    return hf.to(loaded.model.device).eval()


def run_replica_bench(*, model_dir: Path | None = None, preset: str = "small",
                      prefill_tokens: Sequence[int] = (512, 2000, 8000),
                      prompt_tokens: int = 2000, reps: int = 3,
                      concurrencies: Sequence[int] = (1, 8, 32), decode_new_tokens: int = 32,
                      device: torch.device | None = None, attn_impl: str = "sdpa",
                      max_tokens_per_step: int | None = None) -> ReplicaBenchReport:
    """Without `model_dir`, generates `preset` with its context raised to fit the longest
    prompt (the `small` preset serves 4,096 positions; 8,000 tokens need more)."""
    device = device or default_device()
    budget = max_tokens_per_step or EngineConfig().max_tokens_per_step
    longest = max([prompt_tokens, *prefill_tokens]) + decode_new_tokens + 1
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        if model_dir is None:
            args = ModelArgs.from_preset(preset)
            if args.max_seq_len < longest:
                args = dataclasses.replace(args, max_seq_len=-(-longest // 1024) * 1024)
            model_name = f"{preset} (context {args.max_seq_len})"
            model_dir = Path(tmp) / preset
            generate_checkpoint(model_dir, args, seed=0)
        else:
            model_name = Path(model_dir).name
        loaded = load_checkpoint(model_dir, device=device, attn_impl=attn_impl)
        if longest > loaded.args.max_seq_len:
            raise ValueError(f"prompts of up to {longest - decode_new_tokens - 1} tokens do not "
                             f"fit the model's context of {loaded.args.max_seq_len}")
        hf = _load_transformers(model_dir, loaded)
    b = _Bench(loaded, hf, model_name, budget)
    prompt = _tokens(prompt_tokens, 7)
    prefill = _prefill_vs_transformers(b, sorted({*prefill_tokens, prompt_tokens}), reps)
    main = next(p for p in prefill if p.tokens == prompt_tokens)
    blocks = prompt_tokens // BLOCK_SIZE + 2
    t_t0, c_t0, t_at_position = _t0_hit_beside_floor(b, prompt, reps)
    # No T0: every hit is copied from the host pool (pinned when CUDA is present).
    t_t1, c_t1 = _hit_ttft(b, prompt, _cache(loaded, t0=0, t1=blocks), reps)
    t_suffix = _miss_ttft(b, prompt[c_t0:], reps)
    copy_s, raw_s, copy_bytes = _t1_copy(b, prompt, reps)
    cuda = device.type == "cuda"
    decode = [DecodeFigures(c, _decode(b, c, decode_new_tokens, reps, cache=False),
                            _decode(b, c, decode_new_tokens, reps, cache=True),
                            _hf_decode(b, c, decode_new_tokens, reps),
                            _decode(b, c, decode_new_tokens, reps, cache=False, graphs="off")
                            if cuda else None) for c in concurrencies]
    det_ttft = _miss_ttft(b, prompt, reps, deterministic=True)
    det_c = min(8, max(concurrencies))
    fast_tok_s = next((d.decode_tok_s for d in decode if d.concurrency == det_c), None)
    if fast_tok_s is None:
        fast_tok_s = _decode(b, det_c, decode_new_tokens, reps, cache=False)
    det_tok_s = _decode(b, det_c, decode_new_tokens, reps, cache=False, deterministic=True)
    # In-flight load: the largest concurrency, each request a hit on its own prompt_tokens
    # prefix (c_t0 tokens cached) generating decode_new_tokens; a budget of twice that load.
    inflight = max(concurrencies)
    per_request = -(-(prompt_tokens + decode_new_tokens) // BLOCK_SIZE)
    prefix_blocks = inflight * (c_t0 // BLOCK_SIZE)
    prefill_s, lookup_s, store_s, drain_s = _miss_cost(b, prompt, reps)
    a = loaded.args
    return ReplicaBenchReport(
        device=str(device),
        model=f"{model_name}: {a.n_layers} layers, dim {a.dim}, {a.n_heads}/{a.n_kv_heads} heads, "
              f"{a.dtype}",
        attn_impl=attn_impl, cpu_threads=torch.get_num_threads(),
        max_tokens_per_step=budget, reps=reps, prefill=prefill,
        prompt_tokens=prompt_tokens, ttft_full_prefill_s=main.ttft_full_prefill_s,
        transformers_prefill_s=main.transformers_prefill_s, suffix_prefill_s=t_suffix,
        suffix_at_position_s=t_at_position,
        ttft_t0_hit_s=t_t0, ttft_t1_hit_s=t_t1, cached_tokens_t0=c_t0, cached_tokens_t1=c_t1,
        t1_copy_s=copy_s, raw_copy_s=raw_s, t1_copy_bytes=copy_bytes,
        decode=decode, decode_new_tokens=decode_new_tokens,
        deterministic_ttft_s=det_ttft, deterministic_concurrency=det_c,
        fast_tok_s=fast_tok_s, deterministic_tok_s=det_tok_s,
        kv_budget_blocks=2 * inflight * per_request, inflight_requests=inflight,
        inflight_blocks=inflight * per_request, inflight_prefix_blocks=prefix_blocks,
        prefill_s=prefill_s, miss_lookup_s=lookup_s, miss_store_path_s=store_s,
        store_drain_s=drain_s,
    )
