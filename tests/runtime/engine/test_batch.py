"""The persistent decode batch: rows kept across steps give the same inputs as rebuilding them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from kvfleet_runtime.engine import Finished, GenerationRequest, SamplingParams, TokenEvent
from kvfleet_runtime.engine._batch import DecodeBatch
from kvfleet_runtime.model import LoadedModel, PagedKV
from kvfleet_runtime.wire import BLOCK_SIZE

from .conftest import EngineFactory

CPU = torch.device("cpu")


def rebuilt(entries: dict[str, tuple[list[int], int, int]], order: list[str]
            ) -> tuple[list[int], list[int], list[list[int]]]:
    """What the list API would build from scratch for the batch's rows, in row order."""
    nb = max(entries[n][1] for n in order) // BLOCK_SIZE + 1
    ids = [entries[n][2] for n in order]
    pos = [entries[n][1] for n in order]
    tables = [(entries[n][0] + [entries[n][0][0]] * nb)[:nb] for n in order]
    return ids, pos, tables


def test_rows_follow_adds_removes_and_steps() -> None:
    batch: DecodeBatch[str] = DecodeBatch(capacity=4, max_blocks=6, device=CPU)
    entries = {"a": ([3, 4], 17, 7), "b": ([9], 5, 8), "c": ([1, 2, 5, 6], 50, 9)}
    for name, (table, position, token) in entries.items():
        batch.add(name, table, position, token)
    for step in range(3):
        ids, pos, tables = batch.inputs()
        want = rebuilt(entries, batch.seqs)
        assert (ids.tolist(), pos.tolist(), tables.tolist()) == want, step
        if step == 0:
            batch.remove("a")  # the last row ("c") moves into row 0
            del entries["a"]
            assert batch.seqs == ["c", "b"] and "a" not in batch
        new = {n: 100 + step + i for i, n in enumerate(batch.seqs)}
        batch.advance([new[n] for n in batch.seqs])
        for n in batch.seqs:
            table, position, _ = entries[n]
            entries[n] = (table, position + 1, new[n])
    batch.remove("b")
    batch.remove("c")
    assert len(batch) == 0


def test_refuses_what_a_row_cannot_hold() -> None:
    batch: DecodeBatch[str] = DecodeBatch(capacity=1, max_blocks=2, device=CPU)
    with pytest.raises(ValueError, match="cannot hold position"):
        batch.add("a", [1], BLOCK_SIZE, 0)  # position 16 needs a second block
    with pytest.raises(ValueError, match="cannot hold position"):
        batch.add("a", [1, 2, 3], 0, 0)
    batch.add("a", [1], 3, 0)
    with pytest.raises(ValueError, match="holds 1"):
        batch.add("b", [2], 0, 0)
    with pytest.raises(ValueError, match="2 tokens for 1 rows"):
        batch.advance([1, 2])


def test_decode_from_kept_rows_equals_the_list_api_bitwise(loaded: LoadedModel) -> None:
    """Three steps through the batch (a sequence leaving after the first) give the logits the
    list API gives for the same tokens, positions and tables."""
    model = loaded.model
    prompts = [list(range(1, 20)), list(range(5, 45)), list(range(7, 10))]
    kv_a = PagedKV.allocate(model.args, 16, device=CPU)
    kv_b = PagedKV.allocate(model.args, 16, device=CPU)
    tables = [[0, 1], [2, 3, 4, 5], [6]]
    for prompt, table in zip(prompts, tables, strict=True):
        model.prefill(prompt[:-1], 0, table, kv_a)
        model.prefill(prompt[:-1], 0, table, kv_b)
    batch: DecodeBatch[int] = DecodeBatch(capacity=4, max_blocks=8, device=CPU)
    state = {i: (p[-1], len(p) - 1) for i, p in enumerate(prompts)}
    for i in state:
        batch.add(i, tables[i], state[i][1], state[i][0])
    for step in range(3):
        got = model.decode_step(*batch.inputs(), kv_a)
        order = list(batch.seqs)
        want = model.decode([state[i][0] for i in order], [state[i][1] for i in order],
                            [tables[i] for i in order], kv_b)
        assert torch.equal(got, want), step
        nxt = {i: int(row.argmax()) for i, row in zip(order, got, strict=True)}
        if step == 0:
            batch.remove(0)
        batch.advance([nxt[i] for i in batch.seqs])
        state = {i: (nxt[i], state[i][1] + 1) for i in batch.seqs}
    assert torch.equal(kv_a.k, kv_b.k) and torch.equal(kv_a.v, kv_b.v)


def test_a_step_wakes_the_loop_at_most_once_and_events_keep_their_order(
    make_engine: EngineFactory,
) -> None:
    """Tokens reach the streams in order and complete, yet the engine thread wakes the loop about
    twice per step at most (its return, the return of a step's rest after first tokens, a flush
    before the decode forward), not once per token."""
    engine = make_engine(max_batch_size=8)
    prompts = [tuple(range(1 + i, 20 + 3 * i)) for i in range(8)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    wakeups, steps = [0], [0]

    async def body() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name.startswith("kvfleet-engine"):
                wakeups[0] += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        step = engine._step

        def counted_step() -> bool:
            steps[0] += 1
            return step()

        engine._step = counted_step  # type: ignore[method-assign]
        await engine.start()
        try:
            streams = [engine.submit(GenerationRequest("t", p, params)) for p in prompts]
            outs = []
            for s in streams:
                events = [e async for e in s]
                assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 12
                outs.append([e.token_id for e in events if isinstance(e, TokenEvent)])
            return outs
        finally:
            await engine.stop()

    outs = asyncio.run(body())
    assert all(len(o) == 12 for o in outs)
    # The first step prefills all eight, samples their first tokens and decodes the second.
    # Per step: one wake-up as it returns (the executor's future), at most one flush.
    assert 11 <= steps[0] < 8 * 12 and wakeups[0] <= 2 * steps[0]
