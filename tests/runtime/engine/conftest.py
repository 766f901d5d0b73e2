"""Shared fixtures: one tiny checkpoint per session and a factory for engines with a real cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache
from kvfleet_runtime.engine import CacheKeyFields, Engine, EngineConfig
from kvfleet_runtime.model import LoadedModel, load_checkpoint
from tests.support import tiny_dir

__all__ = ["EngineFactory", "loaded", "make_cache", "make_engine", "tiny_dir"]


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread() -> None:
    # A tiny model on a small shared CPU: one intra-op thread is faster than a spinning team.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def loaded(tiny_dir: Path) -> LoadedModel:
    return load_checkpoint(tiny_dir, device=torch.device("cpu"))


def make_cache(loaded: LoadedModel, *, t0: int = 256, t1: int = 0,
               admit_min_sightings: int = 1) -> PrefixCache:
    a = loaded.args
    return PrefixCache(
        CacheTuning(num_t0_blocks=t0, num_t1_blocks=t1, admit_min_sightings=admit_min_sightings),
        KVLayout(a.n_layers, a.n_kv_heads, a.head_dim, dtype="float32"),
        clock=time.monotonic,
        device="cpu",
    )


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(loaded: LoadedModel) -> EngineFactory:
    def factory(cache: PrefixCache | None = None, *, key_fields: CacheKeyFields | None = None,
                **config: int) -> Engine:
        fields = key_fields or CacheKeyFields.for_model(loaded, "tiny")
        return Engine(loaded.model, fields, cache=cache,
                      config=EngineConfig(**{"num_kv_blocks": 128, **config}))

    return factory
