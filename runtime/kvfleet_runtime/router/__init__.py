"""The router: the fleet's OpenAI-compatible front proxy around the picker.

The choice of a replica (fleet view, load polling, config watching, hint index, KV events, the
pure decision) is `kvfleet_runtime.picker`, shared with the gateway's endpoint picker; this
package is the aiohttp shell: authentication, proxy and failover, stream relay, probes, metrics.
It never imports torch.
"""

from __future__ import annotations

from kvfleet_runtime.router._app import create_router_app
from kvfleet_runtime.router._state import RouterState

__all__ = ["RouterState", "create_router_app"]
