"""Answers from a replica to the client: a whole answer's headers, and an SSE stream relayed
with its first token held back (so a replica that fails before it is failed over like a
non-streamed request; after it, a cut is an error event in the stream, OpenAI's shape, never a
silent close). A write to a client that went away raises `ClientGone`; a try that failed before
anything went to the client raises `Failover` (the proxy tries the next replica)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvfleet_runtime.api import error_body, is_client_gone
from kvfleet_runtime.picker import Target
from kvfleet_runtime.router._sse import EventTooLarge, SseEvents, data_lines, error_event
from kvfleet_runtime.router._state import RouterState

__all__ = ["Attempt", "ClientGone", "Failover", "answer_headers", "client_write", "has_token",
           "relay_stream"]

log = logging.getLogger(__name__)

_FORWARD_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "Retry-After")


@dataclass(slots=True)
class Attempt:
    name: str
    decision: Target
    out: web.StreamResponse | None = None
    """The client's response once it started (nothing can be retried after that)."""


class Failover(Exception):
    """This replica's try failed before anything went to the client: try the next one."""

    def __init__(self, outcome: str, detail: str, *, back_off: bool = False) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.back_off = back_off
        """The replica's own reports cannot be trusted for this (it says ready and does not
        answer): keep it out of decisions for `RouterState.replica_backoff_s`."""


_MAX_HELD_STREAM_BYTES = 1 << 16
"""Stream bytes held back waiting for a token (the opening role chunks are ~200 bytes each)."""


def has_token(events: list[bytes]) -> bool:
    """Whether one of these whole SSE events carries a token, a finish, an error or the end:
    once it goes to the client, the answer is committed."""
    for event in events:
        for line in data_lines(event):
            payload = line.strip()
            if payload == b"[DONE]":
                return True
            try:
                data = json.loads(payload)
            except ValueError:
                return True  # not ours to judge: pass it on
            if not isinstance(data, dict) or "error" in data:
                return True
            for choice in data.get("choices") or []:
                if not isinstance(choice, dict):
                    return True
                delta = choice.get("delta")
                delta = delta if isinstance(delta, dict) else {}
                if (choice.get("text") or delta.get("content") or delta.get("tool_calls")
                        or choice.get("finish_reason") or choice.get("logprobs")):
                    return True
    return False


def answer_headers(upstream: aiohttp.ClientResponse, decision: Target) -> dict[str, str]:
    headers = {h: upstream.headers[h] for h in _FORWARD_RESPONSE_HEADERS if h in upstream.headers}
    headers.update(
        {h: v for h, v in upstream.headers.items() if h.lower().startswith("x-kvfleet-")})
    headers["X-Kvfleet-Replica"] = decision.replica
    headers["X-Kvfleet-Route"] = decision.reason
    return headers


async def client_write(step: Awaitable[Any]) -> None:
    """A write to the client; one that went away raises `ClientGone`."""
    try:
        await step
    except Exception as exc:
        if is_client_gone(exc):
            raise ClientGone from exc
        raise


class ClientGone(Exception):
    """The client closed its connection while the answer was being sent."""


async def relay_stream(state: RouterState, request: web.Request,
                       upstream: aiohttp.ClientResponse, attempt: Attempt,
                       first_byte_by: float) -> web.StreamResponse:
    """SSE: events are held back until one carries a token (or the end), so a replica that
    fails before its first token is failed over like a non-streamed request; after that, a
    cut is an error event in the stream (OpenAI's shape), never a silent close. Only whole
    events are forwarded (`router._sse`): the part of an event a cut leaves is dropped, so
    the error event never lands inside a half-written one."""
    loop = asyncio.get_running_loop()
    events = SseEvents()
    held: list[bytes] = []
    num_held_bytes = 0
    while True:
        left_s = first_byte_by - loop.time()
        try:
            if left_s <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(upstream.content.readany(), left_s)
        except TimeoutError:
            raise Failover("first_byte_timeout", "no token within "
                            f"{state.upstream_first_byte_timeout_s:g} s",
                            back_off=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Failover("broken", f"stream cut before its first token "
                            f"({type(exc).__name__})", back_off=True) from None
        if not chunk:
            raise Failover("broken", "stream ended before its first token", back_off=True)
        try:
            whole = events.feed(chunk)
        except EventTooLarge as exc:
            raise Failover("bad_gateway", str(exc), back_off=True) from None
        held += whole
        num_held_bytes += sum(map(len, whole))
        if has_token(whole) or num_held_bytes + len(events.partial) > _MAX_HELD_STREAM_BYTES:
            break
    resp = web.StreamResponse(status=200, headers=answer_headers(upstream, attempt.decision))
    attempt.out = resp
    await client_write(resp.prepare(request))
    if held:
        await client_write(resp.write(b"".join(held)))
    while True:
        why = ""
        try:
            chunk = await asyncio.wait_for(upstream.content.readany(),
                                           state.upstream_read_timeout_s)
            whole = events.feed(chunk)
        except (TimeoutError, aiohttp.ClientError, OSError, EventTooLarge) as exc:
            why = (f"no data for {state.upstream_read_timeout_s:g} s"
                   if isinstance(exc, TimeoutError) else
                   str(exc) if isinstance(exc, EventTooLarge) else type(exc).__name__)
        else:
            if not chunk and events.partial.strip():
                why = f"stream ended inside an event ({len(events.partial)} bytes)"
            elif not chunk:
                break
        if why:
            state.m_requests.labels(attempt.name, "broken").inc()
            log.warning("replica %s failed mid-stream (%s); ending the stream with an "
                        "error event", attempt.name, why)
            event = error_body(502, f"the replica failed mid-stream ({why}); the answer "
                               "is incomplete", code="upstream_failed")
            with contextlib.suppress(Exception):
                await resp.write(error_event(event))
                await resp.write_eof()
            return resp
        if whole:
            await client_write(resp.write(b"".join(whole)))
    await client_write(resp.write_eof())
    state.m_requests.labels(attempt.name, "200").inc()
    return resp
