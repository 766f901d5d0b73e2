"""The replica HTTP server: OpenAI-compatible completions over the engine, cache control, probes."""

from kvfleet_runtime.server._app import (
    ApiError,
    Replica,
    apply_config,
    build_replica,
    create_app,
    openapi_document,
)
from kvfleet_runtime.server._auth import ReplicaAuth
from kvfleet_runtime.server._config import (
    CONFIG_ENV,
    ENV_PREFIX,
    CacheSettings,
    EngineSettings,
    Limits,
    ReplicaConfig,
    load_config,
)
from kvfleet_runtime.server._schemas import CompletionRequest, InvalidateRequest

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "ApiError",
    "CacheSettings",
    "CompletionRequest",
    "EngineSettings",
    "InvalidateRequest",
    "Limits",
    "Replica",
    "ReplicaAuth",
    "ReplicaConfig",
    "apply_config",
    "build_replica",
    "create_app",
    "load_config",
    "openapi_document",
]
