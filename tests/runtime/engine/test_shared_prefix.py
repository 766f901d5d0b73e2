"""Requests with the same prefix that arrive together: the later ones wait at admission until
the first has computed and stored the shared blocks, then hit them, as vLLM's scheduler
effectively does; requests without a shared block, another tenant's, and the answers themselves
are unaffected."""

from __future__ import annotations

import asyncio

from kvfleet_runtime.engine import GenerationRequest, RequestStream, SamplingParams
from kvfleet_runtime.model import LoadedModel
from kvfleet_runtime.wire import BLOCK_SIZE

from .conftest import EngineFactory, make_cache
from .test_engine import tokens

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PREFIX = tokens(4 * BLOCK_SIZE, seed=21)


async def _together(make_engine: EngineFactory, loaded: LoadedModel,
                    requests: list[GenerationRequest]) -> tuple[list[tuple[list[int], int]], int]:
    """Submit all at once (before the engine's first step); (tokens, cached) each, and the
    prompt tokens the engine computed."""
    engine = make_engine(make_cache(loaded))
    streams = [engine.submit(r) for r in requests]  # queued before the scheduler runs
    await engine.start()
    try:
        out = []
        for stream in streams:
            toks: list[int] = []
            async for event in stream:
                if hasattr(event, "token_id"):
                    toks.append(event.token_id)
                else:
                    out.append((toks, event.cached_tokens))
        return out, int(engine.metrics.prefilled_tokens._value.get())
    finally:
        await engine.stop()


async def test_the_second_waits_for_the_first_prefill_and_hits_it(
        make_engine: EngineFactory, loaded: LoadedModel) -> None:
    prompts = [PREFIX + tokens(9, seed=s) for s in (1, 2, 3)]
    reqs = [GenerationRequest("acme", p, GREEDY) for p in prompts]
    out, computed = await _together(make_engine, loaded, reqs)
    assert [cached for _, cached in out] == [0, len(PREFIX), len(PREFIX)]
    assert computed == sum(len(p) for p in prompts) - 2 * len(PREFIX)
    # The same answers as each request alone on a cold engine.
    for (toks, _), req in zip(out, reqs, strict=True):
        alone, _ = await _together(make_engine, loaded, [req])
        assert toks == alone[0][0]


async def test_no_shared_block_or_another_tenant_does_not_wait(
        make_engine: EngineFactory, loaded: LoadedModel) -> None:
    short = (*PREFIX[:BLOCK_SIZE - 1], 7)  # shares less than one block
    reqs = [GenerationRequest("acme", (*PREFIX, 1, 2), GREEDY),
            GenerationRequest("acme", short, GREEDY),
            GenerationRequest("globex", (*PREFIX, 3, 4), GREEDY)]
    out, computed = await _together(make_engine, loaded, reqs)
    assert [cached for _, cached in out] == [0, 0, 0]
    assert computed == sum(len(r.token_ids) for r in reqs)


async def _collect(stream: RequestStream) -> list[object]:
    return [e async for e in stream]


async def test_a_cancelled_first_request_releases_the_waiting_one(
        make_engine: EngineFactory, loaded: LoadedModel) -> None:
    engine = make_engine(make_cache(loaded))
    first = engine.submit(GenerationRequest("acme", (*PREFIX, 1), GREEDY))
    second = engine.submit(GenerationRequest("acme", (*PREFIX, 2), GREEDY))
    first.cancel()
    await engine.start()
    try:
        events = await asyncio.wait_for(_collect(second), 60)
        assert events[-1].finish_reason == "length"  # type: ignore[union-attr]
    finally:
        await engine.stop()
