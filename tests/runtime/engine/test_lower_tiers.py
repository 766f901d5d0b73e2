"""The engine's prepare over the tiers below the cache (`LowerTier`): asked in order after T0
and T1, one allocation, loads landing in the allocated blocks while the request is parked and
the others run; a tier still finding out (None) is asked again; every failure recomputes from
the first gap.

The tier here is a test instrument (`Supply`): it holds the real KV of the prompts (a
deterministic prefill, so what lands equals what the engine would compute, bit for bit) and
answers and lands when the test says so: the timing real tiers (NVMe reads, peer fetches) leave
to chance. The real tiers behind the same interface are tested in tests/runtime/nvme and
tests/runtime/fleet."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvfleet_runtime.cache import (
    EvictedRun,
    LoadTarget,
    LowerTier,
    PrefixCache,
    TierQuery,
    block_hashes,
)
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    Finished,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from kvfleet_runtime.model import LoadedModel, PagedKV
from kvfleet_runtime.nvme import NvmeConfig, NvmeStore, NvmeTier
from kvfleet_runtime.wire import BLOCK_SIZE

from .conftest import make_cache

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(7, 7 + 5 * BLOCK_SIZE + 3))  # 5 usable blocks
OTHER = tuple(range(100, 100 + 2 * BLOCK_SIZE + 1))


def kv_of(loaded: LoadedModel, prompt: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's KV as a deterministic prefill computes it, canonical `[L, H, T, D]`."""
    n = -(-len(prompt) // BLOCK_SIZE)
    kv = PagedKV.allocate(loaded.model.args, n, device=torch.device("cpu"))
    table = kv.take(n)
    assert table is not None
    loaded.model.prefill(tuple(prompt), 0, table, kv, chunk_tokens=BLOCK_SIZE)
    return kv.gather(table, len(prompt))


@dataclass
class Load:
    query: TierQuery
    target: LoadTarget
    done: Callable[[int], None]


@dataclass
class Supply:
    """A `LowerTier` the test drives: `answers` are what `num_matched` says, in turn (the last
    one repeats); `land` lands a started load's leading blocks and calls its `done`."""

    name: str
    kv: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]
    answers: list[int | None]
    asked: list[TierQuery] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    forgotten: list[TierQuery] = field(default_factory=list)

    def num_matched(self, query: TierQuery) -> int | None:
        self.asked.append(query)
        if query.token_ids not in self.kv:
            return 0
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def load_into(self, query: TierQuery, target: LoadTarget,
                  done: Callable[[int], None]) -> None:
        self.loads.append(Load(query, target, done))

    def forget(self, query: TierQuery) -> None:
        self.forgotten.append(query)

    def land(self, num_blocks: int | None = None, *, index: int = 0) -> None:
        load = self.loads[index]
        k, v = self.kv[load.query.token_ids]
        n = len(load.target.block_ids) if num_blocks is None else num_blocks
        for j, block in enumerate(load.target.block_ids[:n]):
            lo = (load.query.start_block + j) * BLOCK_SIZE
            load.target.kv.k[:, block] = k[:, :, lo : lo + BLOCK_SIZE]
            load.target.kv.v[:, block] = v[:, :, lo : lo + BLOCK_SIZE]
        load.done(n)


def test_a_supply_is_a_lower_tier() -> None:
    assert isinstance(Supply("t3", {}, [0]), LowerTier)


def deterministic_engine(loaded: LoadedModel, cache: PrefixCache | None,
                         tiers: Sequence[LowerTier] = (), *,
                         registry: CollectorRegistry | None = None, **config: int) -> Engine:
    return Engine(loaded.model, CacheKeyFields.for_model(loaded, "tiny", deterministic=True),
                  cache=cache, lower_tiers=tiers, registry=registry,
                  config=EngineConfig(**{"num_kv_blocks": 32, "deterministic": True,
                                         "decode_graphs": "off", **config}))


async def until(condition: Callable[[], bool]) -> None:
    """Wait (event-driven steps, not a timed assertion) until `condition` holds."""
    for _ in range(20_000):
        if condition():
            return
        await asyncio.sleep(0.0005)
    raise AssertionError("condition never held")


async def started(engine: Engine, body: Callable[[Engine], Awaitable[None]]) -> None:
    await engine.start()
    try:
        await body(engine)
    finally:
        await engine.stop()


async def collect(stream: object) -> tuple[list[int], Finished]:
    out: list[int] = []
    async for event in stream:  # type: ignore[attr-defined]
        if isinstance(event, TokenEvent):
            out.append(event.token_id)
        else:
            return out, event
    raise AssertionError("no Finished event")


@pytest.fixture
def recomputed(loaded: LoadedModel) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy output without any cache or tier."""
    out: dict[tuple[int, ...], list[int]] = {}

    async def body(engine: Engine) -> None:
        for prompt in (PROMPT, OTHER):
            tokens, fin = await engine.generate(GenerationRequest("acme", prompt, GREEDY))
            assert fin.cached_tokens == 0
            out[prompt] = tokens

    asyncio.run(started(deterministic_engine(loaded, None), body))
    return out


def supply(loaded: LoadedModel, name: str, answers: list[int | None]) -> Supply:
    return Supply(name, {PROMPT: kv_of(loaded, PROMPT)}, answers)


async def test_a_loading_request_is_parked_while_others_run_then_resumes_after_its_blocks(
    loaded: LoadedModel, recomputed: dict[tuple[int, ...], list[int]]
) -> None:
    cache = make_cache(loaded, t0=32)
    t3 = supply(loaded, "t3", [3])
    engine = deterministic_engine(loaded, cache, [t3])

    async def body(engine: Engine) -> None:
        parked = engine.submit(GenerationRequest("acme", PROMPT, GREEDY))
        await until(lambda: bool(t3.loads))
        load = t3.loads[0]
        assert (load.query.start_block, len(load.query.chain)) == (0, 5)
        # One allocation for the whole request (5 blocks of prompt + 1 for its tokens), the
        # tier's three blocks at its head: the engine's first fresh ids.
        assert load.target.block_ids == (0, 1, 2) and load.target.kv is engine.kv
        # Parked: another request is admitted, prefilled and finished meanwhile.
        out, fin = await engine.generate(GenerationRequest("acme", OTHER, GREEDY))
        assert out == recomputed[OTHER] and fin.cached_tokens == 0
        assert engine.num_running == 1 and load.query not in t3.forgotten
        t3.land()
        out, fin = await collect(parked)
        assert out == recomputed[PROMPT]
        assert (fin.cached_tokens, fin.cache_tier) == (3 * BLOCK_SIZE, "t3")
        # The prompt's store indexed the landed blocks like computed ones: a T0 hit now.
        await engine.drain_stores()
        out, fin = await engine.generate(GenerationRequest("acme", PROMPT, GREEDY))
        assert out == recomputed[PROMPT]
        assert (fin.cached_tokens, fin.cache_tier) == (5 * BLOCK_SIZE, "t0")
        # Asked for the first PROMPT and for OTHER (none of it here), not for the last: T0
        # held every usable block.
        assert [q.token_ids for q in t3.asked] == [PROMPT, OTHER] and len(t3.loads) == 1

    await started(engine, body)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


async def test_a_tier_still_finding_out_is_asked_again_and_holds_up_only_its_request(
    loaded: LoadedModel, recomputed: dict[tuple[int, ...], list[int]]
) -> None:
    t2 = supply(loaded, "t2", [None])

    def prompt_asks() -> list[TierQuery]:
        return [q for q in t2.asked if q.token_ids == PROMPT]

    engine = deterministic_engine(loaded, make_cache(loaded, t0=32), [t2])

    async def body(engine: Engine) -> None:
        waiting = engine.submit(GenerationRequest("acme", PROMPT, GREEDY))
        await until(lambda: len(prompt_asks()) >= 2)  # asked again at a later step
        other = asyncio.ensure_future(engine.generate(GenerationRequest("acme", OTHER, GREEDY)))
        await until(other.done)  # admitted and finished while the first one waits
        assert other.result()[0] == recomputed[OTHER] and not t2.loads
        assert engine.num_waiting == 1 and engine.num_running == 0
        t2.answers = [2]
        await until(lambda: bool(t2.loads))
        assert len(set(prompt_asks())) == 1  # the same query each time
        assert t2.loads[0].query == prompt_asks()[0]
        assert len(t2.loads[0].target.block_ids) == 2
        t2.land()
        out, fin = await collect(waiting)
        assert out == recomputed[PROMPT] and (fin.cached_tokens, fin.cache_tier) == (32, "t2")

    await started(engine, body)


async def test_two_tiers_are_asked_in_order_each_for_what_follows_and_land_in_their_blocks(
    loaded: LoadedModel, recomputed: dict[tuple[int, ...], list[int]]
) -> None:
    cache = make_cache(loaded, t0=32)
    t3, t2 = supply(loaded, "t3", [2]), supply(loaded, "t2", [2])
    engine = deterministic_engine(loaded, cache, [t3, t2])

    async def body(engine: Engine) -> None:
        # T0 first: one block of the prompt cached by an earlier, shorter prompt.
        out, fin = await engine.generate(GenerationRequest("acme", PROMPT[:BLOCK_SIZE + 1],
                                                           GREEDY))
        await engine.drain_stores()
        stream = engine.submit(GenerationRequest("acme", PROMPT, GREEDY))
        await until(lambda: bool(t3.loads and t2.loads))
        a, b = t3.loads[0], t2.loads[0]
        assert (a.query.start_block, b.query.start_block) == (1, 3)
        assert a.query.chain == b.query.chain and len(a.query.chain) == 5
        # Block 0 is the T0 hit's (shared); the one allocation's fresh blocks follow in chain
        # order, each tier's where its part of the chain goes.
        assert a.target.block_ids == (1, 2) and b.target.block_ids == (3, 4)
        t2.land()  # in any order: the request resumes once both are done
        t3.land()
        out, fin = await collect(stream)
        assert out == recomputed[PROMPT]
        assert (fin.cached_tokens, fin.cache_tier) == (5 * BLOCK_SIZE, "t2")

    await started(engine, body)


async def test_a_short_or_failed_load_recomputes_from_the_first_gap(
    loaded: LoadedModel, recomputed: dict[tuple[int, ...], list[int]]
) -> None:
    t3, t2 = supply(loaded, "t3", [2]), supply(loaded, "t2", [3])
    engine = deterministic_engine(loaded, make_cache(loaded, t0=32), [t3, t2])

    async def body(engine: Engine) -> None:
        stream = engine.submit(GenerationRequest("acme", PROMPT, GREEDY))
        await until(lambda: bool(t3.loads and t2.loads))
        t3.land(1)  # one of its two blocks verified: the gap is at block 1
        t2.land()  # its three blocks landed, after the gap: recomputed all the same
        out, fin = await collect(stream)
        assert out == recomputed[PROMPT]
        assert (fin.cached_tokens, fin.cache_tier) == (BLOCK_SIZE, "t3")

        stream = engine.submit(GenerationRequest("globex", PROMPT, GREEDY))  # another key
        await until(lambda: len(t3.loads) == 2 and len(t2.loads) == 2)
        t3.loads[1].done(0)  # a failure: nothing after the T0/T1 part is used
        t2.land(index=1)
        out, fin = await collect(stream)
        assert out == recomputed[PROMPT] and (fin.cached_tokens, fin.cache_tier) == (0, None)

    await started(engine, body)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


async def test_a_request_cancelled_while_loading_gives_its_blocks_back_once_the_load_is_done(
    loaded: LoadedModel,
) -> None:
    cache = make_cache(loaded, t0=32)
    t3 = supply(loaded, "t3", [3])
    engine = deterministic_engine(loaded, cache, [t3])

    async def body(engine: Engine) -> None:
        stream = engine.submit(GenerationRequest("acme", PROMPT, GREEDY))
        await until(lambda: bool(t3.loads))
        stream.cancel()
        out, fin = await collect(stream)
        assert (out, fin.finish_reason) == ([], "abort")
        assert t3.loads[0].query in t3.forgotten  # told at once, to stop its transfer
        # The tier may still be writing: its blocks are not handed to anyone before `done`.
        assert engine.kv.num_free_blocks == engine.kv.num_blocks - 6
        t3.land()
        await until(lambda: engine.kv.num_free_blocks == engine.kv.num_blocks)
        assert engine.num_running == 0

    await started(engine, body)


async def test_a_request_cancelled_while_a_tier_finds_out_is_forgotten_there(
    loaded: LoadedModel,
) -> None:
    t2 = supply(loaded, "t2", [None])
    engine = deterministic_engine(loaded, make_cache(loaded, t0=32), [t2])

    async def body(engine: Engine) -> None:
        stream = engine.submit(GenerationRequest("acme", PROMPT, GREEDY))
        await until(lambda: bool(t2.asked))
        stream.cancel()
        _, fin = await collect(stream)
        assert fin.finish_reason == "abort" and t2.forgotten == [t2.asked[0]]
        assert not t2.loads and engine.kv.num_free_blocks == engine.kv.num_blocks

    await started(engine, body)


async def test_t3_lands_a_prompt_it_holds_in_the_engines_blocks_exactly(
    loaded: LoadedModel, recomputed: dict[tuple[int, ...], list[int]], tmp_path: Path
) -> None:
    """The real T3 behind the engine's prepare: a prompt T1 evicted into NVMe is read straight
    into the engine's allocated blocks; the output equals a recompute, the hit reports "t3", and
    the cached tokens are counted by the tier that supplied them."""
    cache = make_cache(loaded, t0=32)
    store = NvmeStore.open(NvmeConfig(tmp_path, 64 * cache.layout.bytes_per_block,
                                      cache.layout.bytes_per_block))
    assert store is not None
    t3 = NvmeTier(cache, store, mode="on", min_sightings=1)
    t3.start()
    registry = CollectorRegistry()
    engine = deterministic_engine(loaded, cache, [t3], registry=registry)
    key = engine.key_fields.key("acme")
    # What T1's eviction sink hands T3: the prompt's first four usable blocks.
    k, v = kv_of(loaded, PROMPT)
    chain = tuple(block_hashes(key, PROMPT[: 4 * BLOCK_SIZE]))
    t3.offer(EvictedRun(key, chain, (2,) * 4, k[:, :, : 4 * BLOCK_SIZE].contiguous(),
                        v[:, :, : 4 * BLOCK_SIZE].contiguous()))
    t3.flush()
    assert len(store) == 4

    async def body(engine: Engine) -> None:
        out, fin = await engine.generate(GenerationRequest("acme", PROMPT, GREEDY))
        assert out == recomputed[PROMPT]
        assert (fin.cached_tokens, fin.cache_tier) == (4 * BLOCK_SIZE, "t3")

    try:
        await started(engine, body)
    finally:
        t3.close()
    assert t3.stats.num_blocks_served == 4
    metrics = generate_latest(registry).decode()
    assert f'kvfleet_replica_cached_prompt_tokens_total{{tier="t3"}} {4.0 * BLOCK_SIZE}' in metrics
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
