"""The decode step's graph machinery: buckets, static buffers and padding rows (eagerly on the
CPU; captured on CUDA, `gpu` marker)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from kvfleet_runtime.model import (
    DecodeGraphs,
    PagedKV,
    Transformer,
    load_checkpoint,
)
from kvfleet_runtime.model._graphs import bucket
from kvfleet_runtime.wire import BLOCK_SIZE


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Transformer:
    return load_checkpoint(tiny_dir, device=torch.device("cpu")).model


def prompt(n: int, seed: int = 1) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 256, (n,), generator=g).tolist())


def test_buckets_are_powers_of_two_up_to_the_cap() -> None:
    assert [bucket(n, 32) for n in (1, 2, 3, 5, 16, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    assert bucket(9, 12) == 12
    with pytest.raises(ValueError):
        bucket(0, 4)
    with pytest.raises(ValueError):
        bucket(5, 4)


def _prefilled(model: Transformer, lengths: list[int]
               ) -> tuple[PagedKV, list[list[int]], list[tuple[int, ...]]]:
    kv = PagedKV.allocate(model.args, 40, device=model.device)
    tables, prompts = [], []
    for n in lengths:
        table = kv.take(n // BLOCK_SIZE + 2)
        assert table is not None
        p = prompt(n + 1, seed=n)
        model.prefill(p[:n], 0, table, kv)
        tables.append(table)
        prompts.append(p)
    return kv, tables, prompts


def _padded(tables: list[list[int]], nb: int) -> torch.Tensor:
    return torch.tensor([(t + [t[0]] * nb)[:nb] for t in tables])


def test_padded_step_computes_the_plain_step_and_writes_only_its_rows_and_the_pad_block(
    model: Transformer,
) -> None:
    """Three rows padded to a bucket of four, 3 blocks to 4: the real rows' logits and KV are
    the plain step's (float tolerance: other matmul shapes), the padding row wrote only slot 0
    of the pad block, and no other block changed."""
    lengths = [20, 45, 7]
    kv_a, tables, prompts = _prefilled(model, lengths)
    kv_b, _, _ = _prefilled(model, lengths)
    pad = kv_a.take(1)
    assert pad is not None and kv_b.take(1) == pad
    ids = torch.tensor([p[-1] for p in prompts])
    pos = torch.tensor(lengths)
    table = _padded(tables, max(lengths) // BLOCK_SIZE + 1)  # 3 blocks: a bucket of 4
    before = kv_a.k.clone()
    graphs = DecodeGraphs(model, kv_a, max_batch=8, max_blocks=8, pad_block=pad[0],
                          capture=False)
    got = graphs(ids, pos, table)
    want = model.decode_step(ids, pos, table, kv_b)
    assert got.shape == want.shape == (3, model.args.vocab_size) and graphs.captured == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    touched = (kv_a.k != before).flatten(2).any(-1)  # [L, blocks]
    rows = {t[p // BLOCK_SIZE] for t, p in zip(tables, lengths, strict=True)}
    assert {int(b) for b in touched.any(0).nonzero()} == rows | {pad[0]}
    assert not kv_a.k[:, pad[0], :, 1:].ne(before[:, pad[0], :, 1:]).any()
    for b in rows:
        torch.testing.assert_close(kv_a.k[:, b], kv_b.k[:, b], rtol=1e-5, atol=1e-5)


def test_capture_needs_cuda(model: Transformer) -> None:
    kv = PagedKV.allocate(model.args, 4, device=model.device)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, kv, max_batch=4, max_blocks=4, pad_block=0, capture=True)


def _engine_tokens(model_dir: Path, device: str, mode: str) -> tuple[list[list[int]], int]:
    loaded = load_checkpoint(model_dir, device=torch.device(device))
    engine = Engine(loaded.model, CacheKeyFields.for_model(loaded, "tiny"), cache=None,
                    config=EngineConfig(num_kv_blocks=64, max_batch_size=8,
                                        decode_graphs=mode))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # Different lengths and ends: rows join, leave and move while the others decode.
    requests = [GenerationRequest("t", prompt(n, seed=n), SamplingParams(
        max_tokens=4 + n % 9, ignore_eos=True)) for n in (3, 17, 40, 64, 5)]
    requests.append(GenerationRequest("t", prompt(33, seed=1), params))

    async def body() -> list[list[int]]:
        await engine.start()
        try:
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.stop()
        return [out for out, _ in results]

    graphs = engine._graphs
    out = asyncio.run(body())
    return out, (graphs.captured if graphs is not None else -1)


def test_engine_on_the_padded_path_generates_what_the_plain_path_does(tiny_dir: Path) -> None:
    """The engine's decode through the graphs' machinery (no capture on the CPU) gives the
    plain step's greedy tokens, while sequences join, finish and move rows."""
    plain, none = _engine_tokens(tiny_dir, "cpu", "off")
    padded, captured = _engine_tokens(tiny_dir, "cpu", "eager")
    assert none == -1 and captured == 0
    assert padded == plain and all(plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_decode_generates_what_the_plain_path_does_on_cuda(tiny_dir: Path) -> None:
    plain, _ = _engine_tokens(tiny_dir, "cuda", "off")
    graphed, captured = _engine_tokens(tiny_dir, "cuda", "auto")
    assert captured > 0
    assert graphed == plain
