"""T0 off and on under a running engine whose KV is the cache's T0 (deterministic mode, so a hit
equals a miss bitwise): a sequence decoding on shared T0 blocks while T0 is turned off finishes
with the recompute's tokens and gives every block back; the drained prefix then hits from T1; new
prompts go to T1 by copy while T0 is off, and are indexed in place again once it is on."""

from __future__ import annotations

import asyncio

from kvfleet_runtime.cache import PrefixCache
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from kvfleet_runtime.model import LoadedModel

from .conftest import make_cache
from .test_engine import tokens

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def deterministic(loaded: LoadedModel, cache: PrefixCache | None) -> Engine:
    return Engine(loaded.model, CacheKeyFields.for_model(loaded, "tiny", deterministic=True),
                  cache=cache, config=EngineConfig(num_kv_blocks=64, deterministic=True))


def used(cache: PrefixCache) -> tuple[int, int]:
    t0, t1 = cache.stats().tiers
    return t0.num_blocks_used, t1.num_blocks_used


async def generate(engine: Engine, prompt: tuple[int, ...],
                   params: SamplingParams = SHORT) -> tuple[list[int], int, str | None]:
    out, fin = await engine.generate(GenerationRequest("acme", prompt, params))
    assert fin.error is None
    await engine.drain_stores()
    return out, fin.cached_tokens, fin.cache_tier


async def test_t0_off_under_a_decoding_sequence_then_t1_hits_then_t0_on_again(
    loaded: LoadedModel,
) -> None:
    cache = make_cache(loaded, t0=64, t1=64)
    engine = deterministic(loaded, cache)
    reference = deterministic(loaded, None)  # no cache: every token recomputed
    assert cache.device_kv is not None and engine.kv.refs is cache.device_kv.refs  # one pool
    a, b, c = tokens(69, seed=31), tokens(53, seed=32), tokens(37, seed=33)  # 4, 3, 2 blocks
    await engine.start()
    await reference.start()
    try:
        expected_long, _, _ = await generate(reference, a, LONG)
        expected = {p: (await generate(reference, p))[0] for p in (a, b, c)}

        out, hit, _ = await generate(engine, a)
        assert (out, hit) == (expected[a], 0)
        assert used(cache) == (4, 0)  # indexed in place in the engine's blocks

        stream = engine.submit(GenerationRequest("acme", a, LONG))
        events = stream.__aiter__()
        first = await events.__anext__()
        assert isinstance(first, TokenEvent) and first.cached_tokens == 64
        assert first.cache_tier == "t0"  # decoding on the 4 shared T0 blocks
        demoted, removed = await asyncio.to_thread(cache.set_t0_enabled, False)
        assert (demoted, removed) == (4, 0)
        out = [first.token_id]
        async for event in events:
            if isinstance(event, TokenEvent):
                out.append(event.token_id)
        assert out == expected_long  # the in-flight sequence kept its blocks
        await engine.drain_stores()
        assert used(cache) == (0, 4)
        kv = engine.kv
        assert (kv.refs.num_free, kv.num_cached_blocks) == (64, 0)  # every block given back

        out, hit, tier = await generate(engine, a)  # the drained prefix: from T1 now
        assert (out, hit, tier) == (expected[a], 64, "t1")
        assert used(cache) == (0, 4)  # and not promoted back into T0
        out, hit, _ = await generate(engine, b)  # a new prompt: copied into T1
        assert (out, hit) == (expected[b], 0)
        assert used(cache) == (0, 7)
        assert (kv.refs.num_free, kv.num_cached_blocks) == (64, 0)

        assert await asyncio.to_thread(cache.set_t0_enabled, True) == (0, 0)
        out, hit, _ = await generate(engine, c)
        assert (out, hit) == (expected[c], 0)
        assert used(cache) == (2, 7)  # indexed in place again
        out, hit, tier = await generate(engine, c)
        assert (out, hit, tier) == (expected[c], 32, "t0")
        cache._manager._index.check_invariants()
    finally:
        await engine.stop()
        await reference.stop()
