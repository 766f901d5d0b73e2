"""The router: the fleet's OpenAI-compatible front door (aiohttp).

    POST /v1/completions        authenticated by `Authorization: Bearer <API key>`; proxied
    POST /v1/chat/completions   (SSE too)
    GET  /v1/models[/{id}]      proxied to a ready replica
    GET  /openapi.json          the replicas' OpenAI schemas (their limits) with the router's auth
    GET  /metrics               Prometheus: decisions by reason, spill_rate, overhead, outcomes,
                                the KV event views (`picker._kv_metrics`)
    GET  /healthz               the event loop answers
    GET  /readyz                keys loaded and at least one replica ready

Every error is OpenAI's JSON envelope (`kvfleet_runtime.api`). The body is read here, within
`max_body_bytes` and `body_read_timeout_s`, and must be acceptable JSON (bounded numbers and
depth, no lone surrogates) before anything is forwarded: a 50 MB body is refused with 413 after
the first byte over the limit, never sent on to a replica.

Per request: API key -> tenant (`picker.Tenancy`: a client-sent `X-Kvfleet-Tenant` is discarded
and replaced, and the API key is not forwarded), then the picker (`kvfleet_runtime.picker`: the
prompt tokenized once, matched tokens from the hint index and vLLM's KV events, the pure
decision and its failover order), then the proxy. A vLLM replica (the fleet config's `engine`)
takes the tenant from the body's `cache_salt`, not from a header: the router replaces that
field, whatever the client sent, with the tenant's signed salt (`Tenancy.vllm_body`).

One job per module, around one small state (`_state.RouterState`, found by every handler as
`request.app[STATE]`):

    _state        settings, the picker and tenancy it composes, the upstream session, metrics
    _inbound      the tenant (API key) and the JSON body every client route reads first
    _proxy        completions: the pick, then the failover over its order
    _relay        answers back to the client: headers, the SSE relay, the failover signal
    _any_replica  the model list, /tokenize, the OpenAPI document, from any ready replica
    _openapi      the router's OpenAPI document (pure)
    _probes       /healthz, /readyz, /health, /version, /metrics
    _app          this: the routes and the lifecycle (upstream pool, the picker's polls)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from kvfleet_runtime.api import ListenerLimits, error_middleware, handler_args
from kvfleet_runtime.router import _any_replica, _probes, _proxy
from kvfleet_runtime.router._state import STATE, RouterState

__all__ = ["create_router_app"]

log = logging.getLogger(__name__)

_HARD_MAX_BODY_BYTES = 64 << 20
"""aiohttp's own cap; `RouterState.max_body_bytes` is checked below it."""


def create_router_app(state: RouterState) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware(log)], client_max_size=_HARD_MAX_BODY_BYTES,
        handler_args=handler_args(ListenerLimits(header_timeout_s=state.header_read_timeout_s)),
    )
    app[STATE] = state
    app.router.add_post("/v1/completions", _proxy.completions)
    app.router.add_post("/v1/chat/completions", _proxy.chat_completions)
    app.router.add_get("/v1/models", _any_replica.models)
    app.router.add_get("/v1/models/{model}", _any_replica.model)
    app.router.add_get("/openapi.json", _any_replica.openapi)
    app.router.add_post("/tokenize", _any_replica.tokenizer_route)
    app.router.add_post("/detokenize", _any_replica.tokenizer_route)
    app.router.add_get("/version", _probes.version)
    app.router.add_get("/health", _probes.health)
    app.router.add_get("/metrics", _probes.metrics)
    app.router.add_get("/healthz", _probes.healthz)
    app.router.add_get("/readyz", _probes.readyz)
    app.cleanup_ctx.append(_lifecycle(state))
    return app


def _lifecycle(state: RouterState) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        own_session = state.session is None
        if own_session:
            state.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=state.upstream_max_connections,
                    limit_per_host=state.upstream_max_connections_per_replica,
                    keepalive_timeout=30,
                ),
                auto_decompress=False,
            )
        await state.picker.start(state.client, poll_interval_s=state.poll_interval_s,
                                 config_poll_s=state.config_poll_s)
        yield
        await state.picker.stop()
        if own_session:
            await state.client.close()
            state.session = None

    return ctx
