"""The engine's decode step, timed (and optionally profiled) at several concurrencies.

    python -m kvfleet_lab.engine.step [--preset tiny | --model-dir DIR] [--concurrency 1,4,16,32]
        [--new-tokens 48] [--prompt-tokens 64] [--reps 1] [--profile]

Per concurrency: that many greedy requests of `--prompt-tokens` random tokens, each generating
`--new-tokens`, through a real engine (no cache); the wall time of every step in which all
sequences decode (median), and the generated tokens/s of whole rounds (prefill included, median
over `--reps` after one warm-up). `--profile` prints cProfile's top entries of those steps.
Prints one `RESULT {json}` line. A before/after comparison runs this module from two checkouts
alternately (`PYTHONPATH=<old checkout>/runtime`), so both see the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from kvfleet_runtime.model import LoadedModel, ModelArgs, generate_checkpoint, load_checkpoint
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = ["main", "measure"]


def measure(loaded: LoadedModel, concurrency: int, *, new_tokens: int, prompt_tokens: int,
            reps: int, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    blocks = concurrency * ((prompt_tokens + new_tokens) // BLOCK_SIZE + 2) + 8
    budget = max(2048, -(-(concurrency + BLOCK_SIZE) // BLOCK_SIZE) * BLOCK_SIZE)
    engine = Engine(loaded.model, CacheKeyFields.for_model(loaded, "step"), cache=None,
                    config=EngineConfig(num_kv_blocks=blocks, max_batch_size=concurrency,
                                        max_tokens_per_step=budget))
    steps: list[float] = []
    step = engine._step

    def timed_step() -> bool:
        decoding = not engine.num_waiting and all(s.output for s in engine._running)
        if profile is not None and decoding:
            profile.enable()
        start = time.perf_counter()
        rest_due = step()
        wall = time.perf_counter() - start
        if profile is not None and decoding:
            profile.disable()
        if decoding:  # a decoding step has no first tokens: it runs whole, rest included
            steps.append(wall)
        return rest_due

    engine._step = timed_step  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(0, min(256, loaded.args.vocab_size), (prompt_tokens,),
                                   generator=g).tolist()) for _ in range(concurrency)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    async def rounds() -> list[float]:
        await engine.start()
        walls = []
        try:
            for _ in range(reps + 1):
                steps.clear()
                start = time.perf_counter()
                await asyncio.gather(*(engine.generate(GenerationRequest("step", p, params))
                                       for p in prompts))
                walls.append(time.perf_counter() - start)
        finally:
            await engine.stop()
        return walls[1:]

    walls = asyncio.run(rounds())
    return {"step_ms_p50": statistics.median(steps) * 1e3 if steps else None,
            "steps": len(steps),
            "tok_s": concurrency * new_tokens / statistics.median(walls)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m kvfleet_lab.engine.step")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="kvfleet-step-") as tmp:
        model_dir = a.model_dir
        if model_dir is None:
            model_dir = Path(tmp) / a.preset
            generate_checkpoint(model_dir, ModelArgs.from_preset(a.preset), seed=0)
        loaded = load_checkpoint(model_dir, device=torch.device("cpu"))
    out: dict[str, Any] = {}
    for c in (int(x) for x in a.concurrency.split(",")):
        prof = cProfile.Profile() if a.profile else None
        out[str(c)] = measure(loaded, c, new_tokens=a.new_tokens, prompt_tokens=a.prompt_tokens,
                              reps=a.reps, profile=prof)
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
            sys.stdout.write(f"=== {c} concurrent: step p50 {out[str(c)]['step_ms_p50']} ms\n"
                             f"{text.getvalue()}\n")
    sys.stdout.write(f"RESULT {json.dumps(out)}\n")
    return out


if __name__ == "__main__":
    main()
