"""The replica's engine: continuous batching over the reference model and the prefix cache."""

from kvfleet_runtime.engine._engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    EngineOverloaded,
    EngineShuttingDown,
    Finished,
    GenerationRequest,
    RequestStream,
    TokenEvent,
)
from kvfleet_runtime.engine._sampling import Sampled, Sampler, SamplingParams, sample_batch

__all__ = [
    "CacheKeyFields",
    "Engine",
    "EngineConfig",
    "EngineOverloaded",
    "EngineShuttingDown",
    "Finished",
    "GenerationRequest",
    "RequestStream",
    "Sampled",
    "Sampler",
    "SamplingParams",
    "TokenEvent",
    "sample_batch",
]
