"""The replica HTTP server: OpenAI-compatible completions over the engine, cache control, probes."""

from kvfleet_runtime.api import ApiError, ChatCompletionRequest, CompletionRequest
from kvfleet_runtime.server._app import (
    apply_config,
    build_replica,
    create_app,
    openapi_document,
)
from kvfleet_runtime.server._auth import ReplicaAuth
from kvfleet_runtime.server._completions import MIN_TOKENS_CODE, system_fingerprint
from kvfleet_runtime.server._config import (
    CONFIG_ENV,
    ENV_PREFIX,
    CacheSettings,
    EngineSettings,
    Limits,
    ReplicaConfig,
    load_config,
)
from kvfleet_runtime.server._schemas import InvalidateRequest
from kvfleet_runtime.server._state import Replica

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "MIN_TOKENS_CODE",
    "ApiError",
    "CacheSettings",
    "ChatCompletionRequest",
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
    "system_fingerprint",
]
