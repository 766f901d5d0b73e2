"""The engine over one block pool: the cache's T0 is the engine's KV (issue 17 item 2).

A T0 hit puts the cached block ids in the sequence's table (no copy, no second pool), a stored
prompt stays in the sequence's blocks, cancellation gives every ref back, a T1 hit copies block
runs into the sequence's blocks, and a hit computes what a miss computes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvfleet_runtime.cache import _cache as cache_module
from kvfleet_runtime.cache._allocator import paired_runs
from kvfleet_runtime.engine import Engine, GenerationRequest, SamplingParams, TokenEvent
from kvfleet_runtime.model import LoadedModel

from .conftest import EngineFactory, make_cache
from .test_engine import GREEDY, run, tokens

LONG = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


async def first_token(engine: Engine, request: GenerationRequest):  # type: ignore[no-untyped-def]
    stream = engine.submit(request)
    events = stream.__aiter__()
    first = await events.__anext__()
    assert isinstance(first, TokenEvent)
    return stream, events, first


async def test_a_t0_hit_places_the_cached_block_ids_and_holds_no_second_copy(
    loaded: LoadedModel, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(loaded, t0=64)
    engine = make_engine(cache)
    kv = engine.kv
    assert cache.device_kv is not None and kv.refs is cache.device_kv.refs
    assert kv.k.data_ptr() == cache.device_kv.k.data_ptr()  # one pool, not two
    assert engine.config.num_kv_blocks == kv.num_blocks == 64
    await engine.start()
    try:
        prompt = tokens(40, seed=3)
        await run(engine, "acme", prompt)  # stores blocks 0 and 1 in place
        cached_ids = [n.block_id for n in cache._manager._index.match(
            cache.block_hashes(engine.key_fields.key("acme"), prompt))]
        assert cached_ids == [0, 1]
        assert (kv.num_cached_blocks, kv.refs.num_free) == (2, 62)
        copies: list[int] = []
        monkeypatch.setattr(cache_module, "copy_runs", lambda *a: copies.append(1) or 1)
        stream, events, first = await first_token(engine, GenerationRequest("acme", prompt, LONG))
        assert (first.cached_tokens, first.cache_tier) == (32, "t0")
        (seq,) = engine._running
        assert seq.table[:2] == cached_ids  # the same blocks, not a copy of them
        need = engine.blocks_needed(len(prompt), LONG.max_tokens)
        # Only the unmatched blocks were taken: the cached prefix is not held twice.
        assert kv.refs.num_free == 64 - 2 - (need - 2)
        assert [kv.refs.ref_count(b) for b in cached_ids] == [1, 1]
        assert copies == []
        stream.cancel()
        async for _ in events:
            pass
        assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 64
        assert [kv.refs.ref_count(b) for b in cached_ids] == [0, 0]
    finally:
        await engine.stop()


async def test_cancelling_a_waiting_hit_and_a_running_hit_gives_every_ref_back(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    cache = make_cache(loaded, t0=12)
    engine = make_engine(cache)
    kv = engine.kv
    await engine.start()
    try:
        prefix = tokens(32, seed=11)
        await run(engine, "acme", prefix)  # 2 cached blocks
        # 15 tokens: no full block, so no store races the first token
        hog = engine.submit(GenerationRequest("zed", tokens(15, seed=12),
                                              SamplingParams(max_tokens=120, ignore_eos=True)))
        hog_events = hog.__aiter__()
        await hog_events.__anext__()  # 9 blocks in flight, 1 free, 2 cached
        assert (kv.refs.num_free, kv.num_cached_blocks) == (1, 2)
        waiting = engine.submit(GenerationRequest("acme", prefix + tokens(16, seed=13),
                                                  SamplingParams(max_tokens=40)))
        for _ in range(200):  # the scheduler looks the waiting request up once, then waits
            await asyncio.sleep(0.01)
            if engine._waiting and engine._waiting[0].looked_up:
                break
        (seq,) = engine._waiting
        assert seq.table == [0, 1] and seq.prefix is not None  # holds its prefix while it waits
        assert [kv.refs.ref_count(b) for b in (0, 1)] == [1, 1]
        waiting.cancel()
        events = [e async for e in waiting]
        assert events[-1].finish_reason == "abort"  # type: ignore[union-attr]
        assert [kv.refs.ref_count(b) for b in (0, 1)] == [0, 0]
        assert all(n.ref_count == 0 for n in cache._manager._index.nodes())
        hog.cancel()
        async for _ in hog_events:
            pass
        stream, events2, first = await first_token(
            engine, GenerationRequest("acme", (*prefix, 5), LONG))
        assert first.cached_tokens == 32
        stream.cancel()
        async for _ in events2:
            pass
        assert kv.num_free_blocks == kv.num_blocks
        assert all(kv.refs.ref_count(b) == 0 for b in range(kv.num_blocks))
        assert all(n.ref_count == 0 for n in cache._manager._index.nodes())
        cache._manager._index.check_invariants()
    finally:
        await engine.stop()


async def test_in_flight_work_reclaims_cached_blocks_and_a_t1_hit_copies_runs(
    loaded: LoadedModel, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(loaded, t0=16, t1=16)
    engine = make_engine(cache)
    kv = engine.kv
    await engine.start()
    try:
        prompt = tokens(70, seed=21)  # 4 full blocks
        expected, cached = await run(engine, "acme", prompt)
        assert cached == 0 and kv.num_cached_blocks == 4
        # A request that needs the whole pool: the cached blocks are demoted to T1 to make room.
        big = GenerationRequest("zed", tokens(200, seed=22),
                                SamplingParams(max_tokens=56, ignore_eos=True))
        out, fin = await engine.generate(big)
        assert fin.finish_reason == "length" and fin.cached_tokens == 0
        await engine.drain_stores()
        key = engine.key_fields.key("acme")
        path = cache._manager._index.match(cache.block_hashes(key, prompt))
        assert [n.tier for n in path] == [1, 1, 1, 1]
        assert cache.stats().tiers[0].num_demotions >= 4
        t1_ids = [n.block_id for n in path]
        counted: list[tuple[list[int], list[int], int]] = []
        original = cache_module.copy_runs

        def spy(src, src_ids, dst, dst_ids):  # type: ignore[no-untyped-def]
            n = original(src, src_ids, dst, dst_ids)
            counted.append((list(src_ids), list(dst_ids), n))
            return n

        monkeypatch.setattr(cache_module, "copy_runs", spy)
        out, cached = await run(engine, "acme", prompt)
        assert (out, cached) == (expected, 64)  # the T1 hit answers like the miss
        (src_ids, dst_ids, n), = counted
        assert src_ids == t1_ids and n == len(paired_runs(t1_ids, dst_ids)) == 1
        promoted = cache._manager._index.match(cache.block_hashes(key, prompt))
        assert [p.tier for p in promoted] == [0, 0, 0, 0]
        assert [p.block_id for p in promoted] == dst_ids  # filed in T0 where the copy landed
        cache._manager._index.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        await engine.stop()


async def test_a_hit_computes_what_a_miss_computes(
    loaded: LoadedModel, make_engine: EngineFactory
) -> None:
    """Cached KV vs recomputed KV of the same prompt, block by block, and the greedy answer."""
    cache = make_cache(loaded, t0=64)
    engine = make_engine(cache)
    miss_engine = make_engine(None)
    kv = engine.kv
    await engine.start()
    await miss_engine.start()
    try:
        prompt = tokens(75, seed=31)
        await run(engine, "acme", prompt)
        stream, events, first = await first_token(engine, GenerationRequest("acme", prompt, LONG))
        assert first.cached_tokens == 64
        (hit_seq,) = engine._running
        mstream, mevents, mfirst = await first_token(
            miss_engine, GenerationRequest("acme", prompt, LONG))
        assert mfirst.cached_tokens == 0 and mfirst.token_id == first.token_id
        (miss_seq,) = miss_engine._running
        n = len(prompt)
        hk, hv = kv.gather(hit_seq.table, n)
        mk, mv = miss_engine.kv.gather(miss_seq.table, n)
        torch.testing.assert_close(hk, mk, rtol=0, atol=1e-5)
        torch.testing.assert_close(hv, mv, rtol=0, atol=1e-5)
        for s in (stream, mstream):
            s.cancel()
        for it in (events, mevents):
            async for _ in it:
                pass
        out_hit, cached = await run(engine, "acme", prompt, GREEDY)
        out_miss, _ = await run(miss_engine, "acme", prompt, GREEDY)
        assert cached == 64 and out_hit == out_miss
    finally:
        await engine.stop()
        await miss_engine.stop()


@pytest.mark.parametrize("max_tokens", [1, 3])
async def test_the_first_token_reaches_its_reader_before_the_prompt_is_stored(
    loaded: LoadedModel, make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch,
    max_tokens: int,
) -> None:
    # The store is the cache's plan for the whole prompt: it must not sit between the first
    # token and its client. When the store runs, the stream's reader has the token already
    # (sent from the engine thread mid-step, it waited for the thread's Python work).
    cache = make_cache(loaded, t0=64)
    engine = make_engine(cache)
    received: list[int] = []
    received_at_store: list[list[int]] = []
    finish = cache.finish

    def watched_finish(*args: object, **kwargs: object) -> object:
        if len(args) > 1:  # a store (a release alone passes no tokens)
            received_at_store.append(list(received))
        return finish(*args, **kwargs)  # type: ignore[arg-type]

    async def read(prompt: tuple[int, ...]) -> int:
        cached = -1
        async for event in engine.submit(GenerationRequest("acme", prompt, params)):
            if isinstance(event, TokenEvent):
                received.append(event.token_id)
                cached = event.cached_tokens
        await engine.drain_stores()
        return cached

    monkeypatch.setattr(cache, "finish", watched_finish)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    await engine.start()
    try:
        prompt = tokens(40, seed=3)
        cached = await read(prompt)  # a miss
        out = list(received)
        cached2 = await read(prompt)  # a T0 hit
    finally:
        await engine.stop()
    assert (len(out), cached, received, cached2) == (max_tokens, 0, out + out, 32)
    assert received_at_store == [out[:1], out + out[:1]]
