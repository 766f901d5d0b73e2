"""The replica HTTP server (aiohttp): OpenAI-compatible completions, cache control, probes, metrics.

Routes:
    POST /v1/completions      OpenAI-compatible; tenant from the `X-Kvfleet-Tenant` header
    POST /v1/chat/completions OpenAI-compatible chat, rendered with the model's chat template
    GET  /v1/models           the one served model; /v1/models/{id} that model
    GET  /cache/stats         ?tenant=   hit rates, bytes, evictions, tier breakdown
    POST /cache/invalidate    {"model_version": "sha256:..."} -> 202
    GET  /metrics             Prometheus text format
    GET  /healthz, /readyz    liveness (the event loop answers), readiness (model loaded, serving)
    GET  /openapi.json        OpenAPI 3.1, generated from the pydantic request models

Every error is JSON, `{"error": {"message", "type", "param", "code"}}` (`kvfleet_runtime.api`),
and names the problem; bad input is a 4xx and never takes the server down. Only an internal bug
gives a 500.

This module holds the routes and their handlers. The OpenAI endpoints themselves live in
`_completions.py`, what a running replica holds (`Replica`) in `_state.py`, its composition
root in `_build.py`, config reload in `_reload.py`, request checks in `_inbound.py`, the OpenAPI
document in `_openapi.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from kvfleet_runtime import __version__
from kvfleet_runtime.api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ListenerLimits,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_middleware,
    error_response,
    handler_args,
)
from kvfleet_runtime.server._auth import ReplicaAuth, auth_middleware
from kvfleet_runtime.server._build import build_replica
from kvfleet_runtime.server._completions import (
    answer,
    chat_completions,
    completions,
    detokenize,
    tokenize,
)
from kvfleet_runtime.server._inbound import TENANT_RE, json_body, tenant_of, validate_body
from kvfleet_runtime.server._openapi import openapi_document
from kvfleet_runtime.server._reload import apply_config, watch_config
from kvfleet_runtime.server._schemas import (
    TENANT_PATTERN,
    InvalidateAccepted,
    InvalidateRequest,
)
from kvfleet_runtime.server._state import Replica
from kvfleet_runtime.server._tiers import invalidate_local

__all__ = [
    "Replica", "apply_config", "build_replica", "create_app", "openapi_document",
]

log = logging.getLogger(__name__)

_HARD_MAX_BODY_BYTES = 64 << 20
"""aiohttp's own cap; the configured (live) limit is checked below it."""


# ---- handlers --------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


TENANT_LABEL = "tenant"
"""The label that names a tenant: series carrying it are shown only to the metrics token."""


class _FleetWideMetrics:
    """The registry without per-tenant series (what an anonymous scrape of /metrics gets)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            samples = [s for s in family.samples if TENANT_LABEL not in s.labels]
            if samples or not family.samples:
                family.samples = samples
                yield family


def _handlers(replica: Replica, auth: ReplicaAuth) -> dict[str, Handler]:
    async def completions_handler(request: web.Request) -> web.StreamResponse:
        tenant = tenant_of(request)
        data = await json_body(request, replica.config.limits)
        return await completions(replica, request, tenant, validate_body(CompletionRequest, data))

    async def chat_handler(request: web.Request) -> web.StreamResponse:
        tenant = tenant_of(request)
        data = await json_body(request, replica.config.limits)
        return await chat_completions(replica, request, tenant,
                                      validate_body(ChatCompletionRequest, data))

    def card() -> ModelCard:
        return ModelCard(id=replica.model_id, created=0, owned_by="kvfleet",
                         root=replica.config.model_dir,
                         max_model_len=replica.loaded.args.max_seq_len,
                         weights_digest=replica.loaded.weights_digest,
                         object="model", parent=None, permission=[])

    async def tokenize_handler(request: web.Request) -> web.StreamResponse:
        data = await json_body(request, replica.config.limits)
        body: TokenizeCompletionRequest | TokenizeChatRequest
        if isinstance(data, dict) and "messages" in data:
            body = validate_body(TokenizeChatRequest, data, generation=False)
        else:
            body = validate_body(TokenizeCompletionRequest, data, generation=False)
        return answer(await asyncio.to_thread(tokenize, replica, body))

    async def detokenize_handler(request: web.Request) -> web.StreamResponse:
        body = validate_body(DetokenizeRequest, await json_body(request, replica.config.limits),
                         generation=False)
        return answer(await asyncio.to_thread(detokenize, replica, body))

    async def version(request: web.Request) -> web.StreamResponse:
        return web.json_response({"version": __version__})

    async def health(request: web.Request) -> web.StreamResponse:
        # vLLM's probe: 200 with an empty body while the engine runs, else 503.
        return web.Response(status=200 if replica.ready else 503)

    async def models(request: web.Request) -> web.StreamResponse:
        return answer(ModelList(object="list", data=[card()]))

    async def model(request: web.Request) -> web.StreamResponse:
        name = request.match_info["model"]
        if name != replica.model_id:
            raise ApiError(404, f"model {name[:80]!r} is not served here; this replica serves "
                           f"{replica.model_id!r}", param="model", code="model_not_found")
        return answer(card())

    async def cache_stats(request: web.Request) -> web.StreamResponse:
        extra = sorted(set(request.query) - {"tenant"})
        if extra:
            raise ApiError(400, f"unknown query parameter(s): {', '.join(extra)}",
                           param=extra[0], code="unknown_parameter")
        tenant = request.query.get("tenant")
        if tenant is not None and not TENANT_RE.match(tenant):
            raise ApiError(400, f"tenant {tenant[:80]!r} does not match {TENANT_PATTERN}",
                           param="tenant", code="invalid_tenant")
        cache = replica.cache
        enabled = replica.engine.cache is not None
        if cache is None:
            return web.json_response({"enabled": False, "tenant": tenant})
        stats = await asyncio.to_thread(cache.stats, tenant)
        data = dataclasses.asdict(stats)
        data["totals"]["token_hit_rate"] = stats.totals.token_hit_rate
        data["totals"]["request_hit_rate"] = stats.totals.request_hit_rate
        data["enabled"] = enabled
        data["t0_enabled"] = cache.t0_enabled
        data["t1_enabled"] = cache.t1_enabled
        return web.json_response(data)

    async def invalidate(request: web.Request) -> web.StreamResponse:
        body = validate_body(InvalidateRequest, await json_body(request, replica.config.limits))
        if replica.cache is not None or replica.nvme is not None:
            task = asyncio.create_task(
                asyncio.to_thread(invalidate_local, replica, body.model_version))
            replica.background.add(task)
            task.add_done_callback(replica.background.discard)
        return web.json_response(
            InvalidateAccepted(model_version=body.model_version).model_dump(), status=202)

    async def metrics(request: web.Request) -> web.StreamResponse:
        # Tenant names and their hit figures only with the scrape credential (issue 25).
        full = auth.sees_tenant_metrics(request)
        source = replica.registry if full else _FleetWideMetrics(replica.registry)
        resp = web.Response(body=generate_latest(source))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def healthz(request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.StreamResponse:
        body = {"status": "ready" if replica.ready else "not_ready", "model": replica.model_id,
                "weights_digest": replica.loaded.weights_digest,
                "restart_pending": replica.restart_pending,
                "config_polls": replica.config_polls,
                "config_applied_at_poll": replica.config_applied_at_poll,
                "config_errors": dict(replica.config_errors),
                "background_restarts": {name: n for name, n in
                                        replica.supervisor.restarts.items() if n}}
        return web.json_response(body, status=200 if replica.ready else 503)

    async def openapi(request: web.Request) -> web.StreamResponse:
        return web.json_response(openapi_document(replica))

    return {"completions": completions_handler, "chat": chat_handler, "models": models,
            "model": model, "cache_stats": cache_stats,
            "invalidate": invalidate, "metrics": metrics, "healthz": healthz, "readyz": readyz,
            "openapi": openapi, "tokenize": tokenize_handler, "detokenize": detokenize_handler,
            "version": version, "health": health}


# ---- app -------------------------------------------------------------------------------------

def create_app(replica: Replica, *, watch: bool = True,
               auth: ReplicaAuth | None = None) -> web.Application:
    """The replica's app. `auth` None: no router secret (tenant `default` on loopback only)."""
    auth = auth or ReplicaAuth()
    authenticate = auth_middleware(auth, error_response)
    limits = ListenerLimits(header_timeout_s=replica.config.header_read_timeout_s)
    app = web.Application(middlewares=[error_middleware(log), authenticate],
                          client_max_size=_HARD_MAX_BODY_BYTES,
                          handler_args=handler_args(limits))
    h = _handlers(replica, auth)
    app.router.add_post("/v1/completions", h["completions"])
    app.router.add_post("/v1/chat/completions", h["chat"])
    app.router.add_get("/v1/models", h["models"])
    app.router.add_get("/v1/models/{model}", h["model"])
    app.router.add_get("/cache/stats", h["cache_stats"])
    app.router.add_post("/cache/invalidate", h["invalidate"])
    app.router.add_get("/metrics", h["metrics"])
    app.router.add_get("/healthz", h["healthz"])
    app.router.add_get("/readyz", h["readyz"])
    app.router.add_get("/openapi.json", h["openapi"])
    app.router.add_post("/tokenize", h["tokenize"])
    app.router.add_post("/detokenize", h["detokenize"])
    app.router.add_get("/version", h["version"])
    app.router.add_get("/health", h["health"])

    async def lifecycle(app: web.Application) -> Any:
        await replica.engine.start(replica.supervisor)
        watcher = None
        if watch and replica.config_path is not None:
            watcher = replica.supervisor.start("kvfleet-config-watch",
                                               lambda: watch_config(replica))
        replica.ready = True
        yield
        replica.ready = False
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await replica.engine.stop()
        if replica.nvme is not None:
            await asyncio.to_thread(replica.nvme.close)

    app.cleanup_ctx.append(lifecycle)
    return app


