"""The engine over the real prefix cache: hits never change answers, keys isolate, refs return."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet_runtime.cache import CacheTuning, Hit, KVLayout, PrefixCache
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    EngineOverloaded,
    EngineShuttingDown,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from kvfleet_runtime.model import LoadedModel, PagedKV, load_checkpoint
from kvfleet_runtime.wire import BLOCK_SIZE

from .conftest import EngineFactory, make_cache

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (n,), generator=g).tolist())


async def run(engine: Engine, tenant: str, prompt: Sequence[int],
              params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    out, fin = await engine.generate(GenerationRequest(tenant, tuple(prompt), params))
    assert fin.error is None
    await engine.drain_stores()
    return out, fin.cached_tokens


async def with_engine(engine: Engine, body):  # type: ignore[no-untyped-def]
    await engine.start()
    try:
        return await body(engine)
    finally:
        await engine.stop()


def test_deterministic_cached_kv_equals_recomputed_kv_bitwise(loaded: LoadedModel) -> None:
    """Deterministic mode (one-block chunks): prefill -> store -> lookup -> materialize gives the
    recomputed bytes, and a suffix prefill on top of them reproduces the full prefill's KV and
    logits bitwise (CPU float32)."""
    model, cache = loaded.model, make_cache(loaded)
    key = CacheKeyFields.for_model(loaded, "tiny").key("acme")
    prompt = tokens(75, seed=3)

    def full_prefill() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv = PagedKV.allocate(model.args, 8, device=torch.device("cpu"))
        table = kv.take(8)
        assert table is not None
        logits = model.prefill(prompt, 0, table, kv, chunk_tokens=BLOCK_SIZE)
        k, v = kv.gather(table, len(prompt))
        return k, v, logits

    k1, v1, logits1 = full_prefill()
    n_full = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    cache.store(key, prompt[:n_full], k1[:, :, :n_full].clone(), v1[:, :, :n_full].clone())
    cache.drain_store_queue()
    hit = cache.lookup(key, prompt)
    assert isinstance(hit, Hit) and hit.matched_tokens == n_full
    ck, cv = cache.materialize(hit)
    k2, v2, logits2 = full_prefill()  # recomputed, same inputs and shapes
    assert torch.equal(ck, k2[:, :, :n_full]) and torch.equal(cv, v2[:, :, :n_full])

    kv = PagedKV.allocate(model.args, 8, device=torch.device("cpu"))
    table = kv.take(8)
    assert table is not None
    kv.scatter(table, ck, cv)
    logits3 = model.prefill(prompt[n_full:], n_full, table, kv, chunk_tokens=BLOCK_SIZE)
    k3, v3 = kv.gather(table, len(prompt))
    assert torch.equal(k3, k2) and torch.equal(v3, v2) and torch.equal(logits3, logits2)
    assert torch.equal(logits1, logits2)
    cache.release(hit)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(min_value=17, max_value=90),
    seed=st.integers(min_value=0, max_value=2**16),
    shared_blocks=st.integers(min_value=1, max_value=4),
    tier=st.sampled_from(["t0", "t1"]),
)
def test_deterministic_greedy_output_is_identical_for_full_hit_partial_hit_and_miss(
    loaded: LoadedModel, n: int, seed: int, shared_blocks: int, tier: str
) -> None:
    prompt = tokens(n, seed)
    full_usable = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    partial = min(shared_blocks * BLOCK_SIZE, full_usable - BLOCK_SIZE)

    async def body(engine: Engine) -> None:
        miss, cached = await run(engine, "miss-only", prompt)
        assert cached == 0
        full_hit, cached = await run(engine, "miss-only", prompt)  # stored by the first run
        assert cached == full_usable
        assert full_hit == miss
        if partial > 0:
            # Another tenant shares only the first `partial` tokens, then diverges.
            other = prompt[:partial] + tuple((t + 1) % 256 for t in prompt[partial:])
            await run(engine, "partial", other)
            partial_hit, cached = await run(engine, "partial", prompt)
            assert cached == partial
            assert partial_hit == miss

    # T1 only: every hit is copied from the host pool; T0 only: from the device pool.
    cache = make_cache(loaded, t0=256, t1=0) if tier == "t0" else make_cache(loaded, t0=0, t1=256)
    engine = Engine(loaded.model, CacheKeyFields.for_model(loaded, "tiny", deterministic=True),
                    cache=cache, config=EngineConfig(deterministic=True))
    asyncio.run(with_engine(engine, body))
    assert cache.stats().tiers[0 if tier == "t0" else 1].num_blocks_used > 0


FAST_PROMPTS = [(n, seed) for n, seed in ((17, 1), (40, 2), (75, 3), (150, 4), (333, 5))]
"""The fixed prompt set on which the fast path's hits must give the miss's greedy tokens."""


@pytest.mark.parametrize("tier", ["t0", "t1"])
@pytest.mark.parametrize("budget", [64, 2048])
async def test_fast_mode_greedy_output_equals_the_miss_on_a_fixed_prompt_set(
    loaded: LoadedModel, tier: str, budget: int
) -> None:
    # Budget 64: a miss prefills 64-token chunks from 0 while a hit prefills from the hit's end,
    # so hit and miss compute the suffix with other shapes; 2048: the suffix in one call.
    cache = make_cache(loaded, t0=256, t1=0) if tier == "t0" else make_cache(loaded, t0=0, t1=256)
    engine = Engine(loaded.model, CacheKeyFields.for_model(loaded, "tiny"), cache=cache,
                    config=EngineConfig(max_tokens_per_step=budget))

    async def body(engine: Engine) -> None:
        for n, seed in FAST_PROMPTS:
            prompt = tokens(n, seed)
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            miss, cached = await run(engine, f"t{n}", prompt, params)
            hit, cached_again = await run(engine, f"t{n}", prompt, params)
            assert (cached, cached_again) == (0, (n - 1) // BLOCK_SIZE * BLOCK_SIZE)
            assert hit == miss, n

    await with_engine(engine, body)


class ChunkRecorder(Engine):
    """Records each planned prefill chunk's (start, tokens) and how many sequences were
    decoding beside it."""

    chunks: list[tuple[int, int, int]]

    def _prefill_chunks(self, plan):  # type: ignore[no-untyped-def]
        decoding = sum(1 for s in self._running if s.output)
        self.chunks.extend((seq.prefill_pos, n, decoding) for seq, n in plan)
        super()._prefill_chunks(plan)


@pytest.mark.parametrize("deterministic", [False, True])
async def test_a_step_spends_its_token_budget_on_decode_first_then_aligned_prefill_chunks(
    loaded: LoadedModel, deterministic: bool
) -> None:
    engine = ChunkRecorder(loaded.model, CacheKeyFields.for_model(loaded, "tiny"), cache=None,
                           config=EngineConfig(num_kv_blocks=64, max_batch_size=4,
                                               max_tokens_per_step=64,
                                               deterministic=deterministic))
    engine.chunks = []

    async def body(engine: Engine) -> None:
        decoding = engine.submit(GenerationRequest(
            "a", tokens(10, 1), SamplingParams(max_tokens=100, ignore_eos=True)))
        events = decoding.__aiter__()
        await events.__anext__()  # `a` decodes from here on
        out, fin = await engine.generate(GenerationRequest(
            "b", tokens(200, 2), SamplingParams(max_tokens=1, ignore_eos=True)))
        assert fin.prompt_tokens == 200 and len(out) == 1
        decoding.cancel()
        async for _ in events:
            pass

    await with_engine(engine, body)
    b_chunks = [(lo, n, dec) for lo, n, dec in engine.chunks if lo or n > 10]
    # 64 tokens a step, one of them `a`'s decode token: 48-token prefill chunks (whole blocks),
    # then the prompt's 8-token tail.
    assert [(lo, n) for lo, n, _ in b_chunks] == [(0, 48), (48, 48), (96, 48), (144, 48),
                                                  (192, 8)]
    assert all(dec == 1 for _, _, dec in b_chunks)


def _replace(fields: CacheKeyFields, **change: str) -> CacheKeyFields:
    return dataclasses.replace(fields, **change)


@pytest.mark.parametrize(
    "change",
    [
        {"weights_digest": "sha256:" + "0" * 64},
        {"kv_dtype": "float16"},
        {"rope_config_hash": "sha256:" + "1" * 64},
        {"attn_impl_id": "sdpa-chunk16-v1"},
        {"model_id": "tiny-v2"},
        {"tenant": "globex"},
    ],
    ids=lambda c: next(iter(c)),
)
async def test_changing_any_key_field_turns_a_hit_into_a_miss(
    loaded: LoadedModel, make_engine: EngineFactory, change: dict[str, str]
) -> None:
    cache = make_cache(loaded)
    base = CacheKeyFields.for_model(loaded, "tiny")
    prompt = tokens(40, seed=11)
    tenant = change.pop("tenant", "acme")
    warm = make_engine(cache, key_fields=base)
    await warm.start()
    await run(warm, "acme", prompt)
    assert (await run(warm, "acme", prompt))[1] == 32  # a hit under the original key
    await warm.stop()
    other = make_engine(cache, key_fields=_replace(base, **change))
    await other.start()
    try:
        assert (await run(other, tenant, prompt))[1] == 0
    finally:
        await other.stop()


def test_key_fields_come_from_the_model(
    loaded: LoadedModel, tiny_dir: Path, tmp_path: Path
) -> None:
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint

    base = CacheKeyFields.for_model(loaded, "tiny")
    sdpa = CacheKeyFields.for_model(
        load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl="sdpa"), "tiny")
    args = dataclasses.replace(ModelArgs.from_preset("tiny"), rope_theta=500000.0)
    generate_checkpoint(tmp_path / "theta", args, seed=0)
    theta = CacheKeyFields.for_model(load_checkpoint(tmp_path / "theta",
                                                     device=torch.device("cpu")), "tiny")
    generate_checkpoint(tmp_path / "seed1", ModelArgs.from_preset("tiny"), seed=1)
    reseeded = CacheKeyFields.for_model(load_checkpoint(tmp_path / "seed1",
                                                        device=torch.device("cpu")), "tiny")
    assert base.kv_dtype == "float32"
    assert sdpa.attn_impl_id != base.attn_impl_id
    assert theta.rope_config_hash != base.rope_config_hash
    assert reseeded.weights_digest != base.weights_digest
    assert theta.weights_digest == base.weights_digest  # same tensors, only the config differs
    det = CacheKeyFields.for_model(loaded, "tiny", deterministic=True)
    assert det.attn_impl_id == base.attn_impl_id + "-chunk16"
    assert dataclasses.replace(det, attn_impl_id=base.attn_impl_id) == base


def test_engine_config_refuses_a_budget_off_the_block_grid_or_without_prefill_room() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_step 100 is not a positive multiple"):
        EngineConfig(max_tokens_per_step=100)
    with pytest.raises(ValueError, match="max_tokens_per_step 32 leaves no prefill block"):
        EngineConfig(max_tokens_per_step=32, max_batch_size=32)


async def test_a_one_token_request_still_stores_its_prompt(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    engine = make_engine(make_cache(loaded))
    await engine.start()
    try:
        prompt = tokens(40, seed=12)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        await run(engine, "acme", prompt, one)
        assert (await run(engine, "acme", prompt, one))[1] == 32
        assert engine.metrics.cache_errors.labels("store")._value.get() == 0
    finally:
        await engine.stop()


@pytest.mark.parametrize("offset", [16, 5])
async def test_same_tokens_at_another_offset_never_hit(
    loaded: LoadedModel, make_engine: EngineFactory, offset: int
) -> None:
    cache = make_cache(loaded)
    engine = make_engine(cache)
    await engine.start()
    try:
        prompt = tokens(64, seed=5)
        await run(engine, "acme", prompt)
        assert (await run(engine, "acme", prompt))[1] == 48
        shifted = tokens(offset, seed=6) + prompt
        assert (await run(engine, "acme", shifted))[1] == 0
    finally:
        await engine.stop()


class CountingCache(PrefixCache):
    num_held = 0
    fail_materialize = False
    fail_copy = False
    """Only the T1 -> T0 copy fails (`fill`); `fail_materialize`: placing the hit too."""

    def _lookup(self, key, chain, num_tokens):  # type: ignore[no-untyped-def]
        hit = super()._lookup(key, chain, num_tokens)
        if isinstance(hit, Hit):
            self.num_held += 1
        return hit

    def _share_prefix(self, hit, kv, max_blocks):  # type: ignore[no-untyped-def]
        if self.fail_materialize:
            raise RuntimeError("simulated failure placing the hit")
        return super()._share_prefix(hit, kv, max_blocks)

    def _copy_into(self, hit, kv, table, start, stop):  # type: ignore[no-untyped-def]
        if self.fail_materialize or self.fail_copy:
            raise RuntimeError("simulated T1 copy failure")
        return super()._copy_into(hit, kv, table, start, stop)

    def release(self, hit):  # type: ignore[no-untyped-def]
        self.num_held -= 1
        super().release(hit)


def counting_cache(loaded: LoadedModel, t1: int = 0) -> CountingCache:
    base = make_cache(loaded, t1=t1)
    cache = CountingCache(base.config, base.layout, clock=lambda: 0.0, device="cpu")
    return cache


async def test_concurrent_requests_batch_and_release_every_ref(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    cache = counting_cache(loaded)
    engine = make_engine(cache, max_batch_size=4)
    await engine.start()
    try:
        system = tokens(48, seed=1)
        await run(engine, "acme", (*system, 1, 2, 3))
        reqs = [
            GenerationRequest("acme" if i % 2 else "globex", system + tokens(5 + i, seed=100 + i),
                              SamplingParams(max_tokens=4 + i % 5, temperature=0.0))
            for i in range(12)
        ]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        for (out, fin), req in zip(results, reqs, strict=True):
            assert fin.finish_reason in ("length", "stop") and fin.error is None
            assert len(out) == fin.completion_tokens <= req.params.max_tokens
        assert any(fin.cached_tokens == 48 for _, fin in results)
        assert any(fin.cached_tokens == 0 for _, fin in results)
        assert cache.num_held == 0
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        await engine.stop()


async def test_a_new_request_is_admitted_while_another_decodes(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    engine = make_engine(None)
    await engine.start()
    try:
        long = engine.submit(GenerationRequest("a", tokens(20, 1),
                                               SamplingParams(max_tokens=200, ignore_eos=True)))
        it = long.__aiter__()
        await it.__anext__()  # the long one is decoding
        _short_out, short_fin = await engine.generate(
            GenerationRequest("b", tokens(20, 2), SamplingParams(max_tokens=2, ignore_eos=True)))
        assert short_fin.finish_reason == "length"
        remaining = [e async for e in it]
        assert sum(isinstance(e, TokenEvent) for e in remaining) > 100  # still going after b
    finally:
        await engine.stop()


async def test_switching_the_cache_off_mid_request_still_releases_its_refs(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    cache = counting_cache(loaded)
    engine = make_engine(cache)
    await engine.start()
    try:
        prompt = tokens(40, seed=21)
        await run(engine, "acme", prompt)
        stream = engine.submit(GenerationRequest("acme", prompt,
                                                 SamplingParams(max_tokens=50, ignore_eos=True)))
        events = stream.__aiter__()
        first = await events.__anext__()
        assert isinstance(first, TokenEvent) and first.cached_tokens == 32
        engine.cache = None  # what a config reload with cache.enabled: false does
        async for _ in events:
            pass
        assert cache.num_held == 0
    finally:
        await engine.stop()


async def test_cache_failure_degrades_to_recompute(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    cache = counting_cache(loaded)
    engine = make_engine(cache)
    await engine.start()
    try:
        prompt = tokens(50, seed=9)
        expected, _ = await run(engine, "acme", prompt)
        cache.fail_materialize = True
        out, cached = await run(engine, "acme", prompt)
        assert (out, cached) == (expected, 0)
        assert engine.metrics.cache_errors.labels("prepare")._value.get() == 1
        assert cache.num_held == 0
    finally:
        await engine.stop()


async def test_a_failed_t1_copy_is_counted_as_fill_and_recomputes(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    cache = counting_cache(loaded, t1=16)
    cache.set_t0_enabled(False)  # stores go to T1 by copy, hits come back by `fill`
    engine = make_engine(cache)
    await engine.start()
    try:
        prompt = tokens(50, seed=11)
        expected, _ = await run(engine, "acme", prompt)
        await engine.drain_stores()  # the drain task may have written it already
        assert (await run(engine, "acme", prompt))[1] > 0  # a T1 hit, copied in by `fill`
        cache.fail_copy = True
        out, cached = await run(engine, "acme", prompt)
        assert (out, cached) == (expected, 0)
        errors = engine.metrics.cache_errors
        assert (errors.labels("fill")._value.get(), errors.labels("prepare")._value.get()) == (
            1, 0)
        assert cache.num_held == 0
    finally:
        await engine.stop()


async def test_a_stopped_engine_refuses_as_shutting_down_not_overloaded(
    make_engine: EngineFactory
) -> None:
    engine = make_engine(None)
    await engine.start()
    await engine.stop()
    with pytest.raises(EngineShuttingDown, match="shutting down") as info:
        engine.submit(GenerationRequest("t", (1, 2)))
    assert not isinstance(info.value, EngineOverloaded)


async def test_seeded_sampling_is_reproducible(make_engine: EngineFactory) -> None:
    engine = make_engine(None)
    await engine.start()
    try:
        prompt = tokens(30, seed=4)
        def params(seed: int) -> SamplingParams:
            return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        a = (await engine.generate(GenerationRequest("t", prompt, params(7))))[0]
        b = (await engine.generate(GenerationRequest("t", prompt, params(7))))[0]
        c = (await engine.generate(GenerationRequest("t", prompt, params(8))))[0]
        assert a == b and a != c
    finally:
        await engine.stop()


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-8, 2.0])
def test_sampling_is_finite_at_any_temperature(temperature: float) -> None:
    from kvfleet_runtime.engine import Sampler

    logits = torch.tensor([1.0, 3.0, -2.0, 2.999])
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0))
    token = sampler.sample(logits)
    assert 0 <= token < 4
    if temperature < 1e-6:
        assert token == 1


async def test_cancel_frees_blocks(make_engine: EngineFactory) -> None:
    engine = make_engine(None)
    await engine.start()
    try:
        stream = engine.submit(GenerationRequest("t", tokens(30, 1),
                                                 SamplingParams(max_tokens=500, ignore_eos=True)))
        events = []
        async for event in stream:
            events.append(event)
            if len(events) == 3:
                stream.cancel()
        assert events[-1].finish_reason == "abort"  # type: ignore[union-attr]
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        await engine.stop()


def test_submit_refuses_impossible_requests_and_overload(make_engine: EngineFactory) -> None:
    engine = make_engine(None, max_waiting=1, num_kv_blocks=4)
    with pytest.raises(ValueError, match="out of range"):
        engine.submit(GenerationRequest("t", (1, 300)))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(GenerationRequest("t", ()))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.submit(GenerationRequest("t", tokens(60, 1), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="context"):
        engine.submit(GenerationRequest("t", (1,), SamplingParams(max_tokens=5000)))
    engine.submit(GenerationRequest("t", (1, 2)))  # not started: it waits
    with pytest.raises(EngineOverloaded):
        engine.submit(GenerationRequest("t", (1, 2)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("deterministic", [True, False])
def test_hit_equals_miss_on_cuda_with_a_pinned_t1(tiny_dir: Path, deterministic: bool) -> None:
    """The same guarantee on a GPU: T0 in device memory, T1 pinned on the host (and the fast
    path's: the same greedy tokens on this fixed prompt)."""
    loaded = load_checkpoint(tiny_dir, device=torch.device("cuda"))
    prompt = tokens(90, seed=77)
    for t0, t1 in ((256, 0), (0, 256)):
        a = loaded.args
        cache = PrefixCache(CacheTuning(num_t0_blocks=t0, num_t1_blocks=t1,
                                        admit_min_sightings=1),
                            KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype="float32"),
                            clock=lambda: 0.0, device="cuda")
        engine = Engine(loaded.model,
                        CacheKeyFields.for_model(loaded, "tiny", deterministic=deterministic),
                        cache=cache, config=EngineConfig(deterministic=deterministic))

        async def body(engine: Engine) -> None:
            miss, cached = await run(engine, "acme", prompt)
            hit, cached_again = await run(engine, "acme", prompt)
            assert (cached, cached_again) == (0, 80) and hit == miss

        asyncio.run(with_engine(engine, body))
