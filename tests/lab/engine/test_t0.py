"""The before/after of T0 as the engine's KV: the capacity figure is a count, so it is exact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from kvfleet_lab.engine.t0 import _cached_beside_load
from kvfleet_runtime.model import load_checkpoint

LOAD = dict(num_prefixes=48, prefix_tokens=96, system_tokens=128, num_inflight=4,
            suffix_tokens=72, max_tokens=100)


def test_one_pool_holds_more_cached_blocks_beside_the_same_in_flight_load(tiny_dir: Path) -> None:
    loaded = load_checkpoint(tiny_dir, device=torch.device("cpu"))
    # Two pools: the engine's 76 blocks are sized for the load's peak (4 x 19), T0 gets the rest.
    before = asyncio.run(_cached_beside_load(loaded, 256, 76, **LOAD))  # type: ignore[arg-type]
    after = asyncio.run(_cached_beside_load(loaded, 256, None, **LOAD))  # type: ignore[arg-type]
    assert before == 256 - 76
    # One pool: the load holds only its unshared blocks (4 x 11; the system prompt's 8 blocks
    # are the cache's own, shared), and every other block stays cached.
    assert after >= 256 - 4 * 11 - 8 > before
