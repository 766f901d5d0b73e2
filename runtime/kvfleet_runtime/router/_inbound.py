"""What every client route reads first: the tenant (API key) and the JSON body, within limits."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvfleet_runtime.api import ApiError, parse_json, read_body
from kvfleet_runtime.router._state import RouterState

__all__ = ["authenticate", "json_body"]


def authenticate(state: RouterState, request: web.Request) -> str:
    """The request's tenant (`Tenancy.authenticate`); a refusal is counted and answered 401."""
    try:
        return state.tenancy.authenticate(request.headers.get("Authorization"))
    except ApiError:
        state.m_unauthorized.inc()
        raise


async def json_body(state: RouterState, request: web.Request) -> tuple[bytes, dict[str, Any]]:
    """The body as sent and parsed: within `max_body_bytes` and `body_read_timeout_s`, a JSON
    object of bounded numbers and depth, no lone surrogates (`api.parse_json`)."""
    raw = await read_body(request, state.max_body_bytes, state.body_read_timeout_s)
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError(
            400,
            f"request body must be a JSON object, got {type(body).__name__}",
            code="invalid_body",
        )
    return raw, body
