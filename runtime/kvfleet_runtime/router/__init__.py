"""The router: API keys -> tenants, tenant-affinity + cache-aware replica choice, streaming proxy.

Pure decisions live in `kvfleet_runtime.affinity`; this package is the aiohttp shell around them
(fleet view, load polling, config watching, proxying, metrics). It never imports torch.
"""

from __future__ import annotations

from kvfleet_runtime.router._app import (
    RouterState,
    chat_token_ids,
    create_router_app,
    prompt_token_ids,
)
from kvfleet_runtime.router._kv_events import KvEventViews
from kvfleet_runtime.router._view import FleetView, vllm_load_report

__all__ = ["FleetView", "KvEventViews", "RouterState", "chat_token_ids", "create_router_app",
           "prompt_token_ids", "vllm_load_report"]
