"""The router's own probes: liveness, readiness, vLLM's /health and /version, Prometheus."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_runtime import __version__
from kvfleet_runtime.router._state import STATE

__all__ = ["health", "healthz", "metrics", "readyz", "version"]


async def version(request: web.Request) -> web.StreamResponse:
    return web.json_response({"version": __version__})


async def health(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    # vLLM's probe: an empty 200 while the router can place a request on some replica.
    return web.Response(status=200 if any(x.ready for x in state.view.loads()) else 503)


async def metrics(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    resp = web.Response(body=generate_latest(state.registry))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    ready = [x.name for x in state.view.loads() if x.ready]
    ok = bool(ready) and bool(state.tenancy.keys.digest_to_tenant)
    return web.json_response(
        {
            "status": "ready" if ok else "not_ready",
            "ready_replicas": sorted(ready),
            "spill_rate": state.spill_rate,
            "config_generation": state.view.config.generation if state.view.config else None,
            # The last good config routes; this says why the file on disk is not it.
            "config_error": state.view.config_error or None,
            "background_restarts": {name: n for name, n in
                                    state.picker.supervisor.restarts.items() if n},
        },
        status=200 if ok else 503,
    )
