"""Routes any ready replica answers alike (every replica of a fleet serves the same model): the
model list, vLLM's /tokenize and /detokenize, and the OpenAPI document the router's is made from
(`router._openapi`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from urllib.parse import quote

import aiohttp
from aiohttp import web

from kvfleet_runtime.api import ApiError
from kvfleet_runtime.router._inbound import authenticate, json_body
from kvfleet_runtime.router._openapi import router_openapi
from kvfleet_runtime.router._state import STATE, RouterState

__all__ = ["from_a_replica", "model", "models", "openapi", "tokenizer_route"]


async def from_a_replica(state: RouterState, path: str) -> web.Response:
    """GET `path` from the first ready replica that answers with JSON."""
    for base in _ready_urls(state):
        url = base + path
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with state.client.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                return web.json_response(await r.json(), status=r.status)
    raise ApiError(503, "no replica is ready", code="no_replica", headers={"Retry-After": "1"})


def _ready_urls(state: RouterState) -> Iterator[str]:
    """The ready replicas' URLs by name, each looked up when its turn comes: one that left the
    fleet (a config reload) while an earlier one was tried is skipped."""
    for load in sorted(state.view.loads(), key=lambda x: x.name):
        replica = state.view.replicas.get(load.name)
        if load.ready and replica is not None:
            yield replica.url


async def tokenizer_route(request: web.Request) -> web.StreamResponse:
    """vLLM's /tokenize and /detokenize, answered by the first ready replica: every
    replica of a fleet serves the same model, so any one's tokenizer is the model's."""
    state = request.app[STATE]
    authenticate(state, request)
    raw, _ = await json_body(state, request)
    for base in _ready_urls(state):
        url = base + request.path
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            async with state.client.post(
                url, data=raw, headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=30)) as r:
                return web.json_response(await r.json(), status=r.status)
    raise ApiError(503, "no replica is ready", code="no_replica", headers={"Retry-After": "1"})


async def models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    authenticate(state, request)
    return await from_a_replica(state, "/v1/models")


async def model(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    authenticate(state, request)
    return await from_a_replica(state,
                                "/v1/models/" + quote(request.match_info["model"], safe=""))


async def openapi(request: web.Request) -> web.StreamResponse:
    doc = await from_a_replica(request.app[STATE], "/openapi.json")
    assert doc.text is not None
    return web.json_response(router_openapi(json.loads(doc.text)))
