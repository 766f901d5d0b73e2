"""Same-prefix requests that arrive together: kvfleet's cached prompt tokens against the ideal.

The workload is `vllm bench serve`'s `prefix_repetition` shape on token ids: `num_prefixes`
prefixes of `prefix_len` tokens, each prompt one of them plus `suffix_len` tokens of its own, the
prompts shuffled and sent `concurrency` at a time (a new one as soon as one ends). The ideal is
what a cache that never computes a stored block twice gives: every prompt but the first of each
prefix hits the prefix's full blocks (at most up to the block before the last prompt token,
which is always computed). `waiting=False` runs the same burst with the engine's wait for a
running sequence's prefix turned off, the admission before it.

    python -m kvfleet_lab.engine.prefix_burst --concurrency 4 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from kvfleet_runtime.model import LoadedModel, ModelArgs, generate_checkpoint, load_checkpoint
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = ["BurstResult", "run_burst"]


@dataclass(slots=True, frozen=True)
class BurstResult:
    concurrency: int
    waiting: bool
    num_prompts: int
    cached_tokens: int
    ideal_cached_tokens: int
    computed_tokens: int
    wall_s: float


def _prompts(num_prefixes: int, prefix_len: int, suffix_len: int, num_prompts: int,
             seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(256) for _ in range(prefix_len)) for _ in range(num_prefixes)]
    out = [prefixes[i % num_prefixes] + tuple(rng.randrange(256) for _ in range(suffix_len))
           for i in range(num_prompts)]
    rng.shuffle(out)
    return out


def ideal_cached(prompts: list[tuple[int, ...]], prefix_len: int) -> int:
    seen: set[tuple[int, ...]] = set()
    total = 0
    for p in prompts:
        head = p[:prefix_len]
        if head in seen:
            total += min(prefix_len, len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
        seen.add(head)
    return total


async def run_burst(loaded: LoadedModel, *, concurrency: int, waiting: bool,
                    num_prefixes: int = 2, prefix_len: int = 64, suffix_len: int = 16,
                    num_prompts: int = 48, output_len: int = 8, seed: int = 0) -> BurstResult:
    a = loaded.args
    cache = PrefixCache(CacheTuning(num_t0_blocks=512, num_t1_blocks=0, admit_min_sightings=1),
                        KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype=a.dtype),
                        clock=time.monotonic, device="cpu")
    engine = Engine(loaded.model, CacheKeyFields.for_model(loaded, "tiny"), cache=cache,
                    config=EngineConfig(num_kv_blocks=512, max_batch_size=32))
    if not waiting:
        engine._prefix_pending = lambda seq: False  # type: ignore[method-assign]
    prompts = _prompts(num_prefixes, prefix_len, suffix_len, num_prompts, seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    slots = asyncio.Semaphore(concurrency)
    cached: list[int] = []

    async def one(prompt: tuple[int, ...]) -> None:
        async with slots:
            _, fin = await engine.generate(GenerationRequest("bench", prompt, params))
            cached.append(fin.cached_tokens)

    await engine.start()
    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await engine.stop()
    return BurstResult(concurrency, waiting, num_prompts, sum(cached),
                       ideal_cached(prompts, prefix_len),
                       int(engine.metrics.prefilled_tokens._value.get()),
                       time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--num-prompts", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        generate_checkpoint(Path(tmp), ModelArgs.from_preset("tiny"), seed=0)
        loaded = load_checkpoint(Path(tmp), device=torch.device("cpu"))
        for c in args.concurrency:
            for waiting in (False, True):
                result = asyncio.run(run_burst(loaded, concurrency=c, waiting=waiting,
                                               num_prompts=args.num_prompts))
                sys.stdout.write(json.dumps(asdict(result)) + "\n")


if __name__ == "__main__":
    main()
