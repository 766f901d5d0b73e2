"""kvfleet as a vLLM KV connector (vLLM 0.33, `pip install kvfleet[vllm]` in vLLM's own
environment): kvfleet's host tier, cache key, admission and stats for a vLLM replica; vLLM's own
GPU prefix cache stays T0. See docs/vllm.md.

    --kv-transfer-config '{"kv_connector": "KvfleetConnector",
                           "kv_connector_module_path": "kvfleet_vllm.connector", ...}'

Modules: `connector` (the `KVConnectorBase_V1` shell handing each method to its role's side;
imports vllm), `_options` (the extra config, parsed once), `_scheduler` (the scheduler side:
keys, plans, T2, stats) over `_connector_index` (`ConnectorIndex`: kvfleet's `CacheManager`, no
vllm types), `_worker` (the worker side) over `_copy` (host pool <-> paged KV copies, torch
only), `_keys` (the whole cache key of a vLLM replica), `_peer` (T2: the peer server, hint
publishing and fetches, in the engine-core process). Importing this package imports neither
vllm nor torch; `KvfleetConnector` loads `connector` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfleet_vllm.connector import KvfleetConnector

__all__ = ["KvfleetConnector"]


def __getattr__(name: str) -> Any:
    if name != "KvfleetConnector":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvfleet_vllm.connector import KvfleetConnector

    return KvfleetConnector
