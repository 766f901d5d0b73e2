"""One HTTP request's ext_proc stream: read what the picker needs, pick, answer, observe.

    request headers   the path and the API key (-> tenant, 401 here when there is none);
                      a completion with a body waits for it (BUFFERED: headers go on now and
                      the body comes whole; FULL_DUPLEX_STREAMED: nothing goes on until the
                      body is whole); anything else goes to a ready replica at once
    request body      bounded (413), acceptable JSON (400), then the picker: destination and
                      fallbacks, the tenant's assertions, vLLM's salt
    response headers  the served status (counted)
    response body     passed on; the answer's `usage` read from its tail (the JSON answer, or
                      a stream's last usage event)
    stream end        the pick's request leaves the picker's in-flight count

The replica's name and the pick's reason go back to the client as the router's
`X-Kvfleet-Route` does; which pod served (after Envoy's retries) is Envoy's to say (its access
log, `%UPSTREAM_HOST%`).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from kvfleet_runtime.api import ApiError, parse_json
from kvfleet_runtime.epp._protocol import (
    BodyMode,
    Destination,
    body_modes,
    continue_body,
    continue_headers,
    destination_addresses,
    echo_body,
    headers_of,
    immediate_error,
    routed,
)
from kvfleet_runtime.epp._state import EppState
from kvfleet_runtime.picker import Pick, PickRequest
from kvfleet_runtime.wire import ASSERTION_HEADER

__all__ = ["COMPLETION_PATHS", "Exchange", "usage_of"]

log = logging.getLogger(__name__)

COMPLETION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
"""Path -> chat: the requests the picker chooses for by their prompt."""
_OPEN_PATHS = frozenset({"/health", "/version", "/ping", "/metrics"})
"""GETs a replica answers without a tenant (probes): no API key asked."""
USAGE_TAIL_BYTES = 64 << 10
"""How much of an answer's end is kept to read its usage: a stream's last events, or a whole
JSON answer of ordinary size (a larger one's usage is simply not counted)."""


class Exchange:
    """The state of one ext_proc stream (one HTTP request through the gateway)."""

    def __init__(self, state: EppState) -> None:
        self.state = state
        self.request_mode: BodyMode = "none"
        self.response_mode: BodyMode = "none"
        self.method = ""
        self.path = ""
        self.tenant: str | None = None
        self.body = bytearray()
        self.decided = False
        self.pick: Pick | None = None
        self.tail = bytearray()
        self.started = time.perf_counter()

    async def on(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        """The answers to one message, in order (none while a full-duplex body is still
        arriving)."""
        modes = body_modes(message)
        if modes is not None:
            self.request_mode, self.response_mode = modes
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message.request_headers)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            return [ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if kind == "response_headers":
            status = headers_of(message.response_headers).get(":status", "")
            self.state.m_responses.labels(status or "unknown").inc()
            return [continue_headers(response=True)]
        if kind == "response_body":
            return [self._response_body(message.response_body)]
        if kind == "response_trailers":
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        return []

    def close(self) -> None:
        """The stream ended (the request is done, or the client or Envoy went away)."""
        if self.pick is not None:
            self.state.picker.end(self.pick.replica, self.pick.prompt_tokens)
            self.pick = None
        usage = usage_of(bytes(self.tail))
        if usage is not None:
            for kind, n in usage.items():
                self.state.m_usage.labels(kind).inc(n)

    # -- the request -------------------------------------------------------------------------

    async def _request_headers(self, headers: ext_proc.HttpHeaders
                               ) -> list[ext_proc.ProcessingResponse]:
        h = headers_of(headers)
        self.method = h.get(":method", "").upper()
        self.path = h.get(":path", "").split("?", 1)[0]
        if not (self.method == "GET" and self.path in _OPEN_PATHS):
            try:
                self.tenant = self.state.tenancy.authenticate(h.get("authorization"))
            except ApiError as exc:
                self.state.m_requests.labels("unauthorized").inc()
                return [_refusal(exc)]
        waits = (self.method == "POST" and self.path in COMPLETION_PATHS
                 and not headers.end_of_stream and self.request_mode in ("buffered", "full_duplex"))
        if not waits:
            self.decided = True
            answer = await self._destination(None)
            return [answer if isinstance(answer, ext_proc.ProcessingResponse)
                    else routed(answer, phase="headers")]
        return [continue_headers()] if self.request_mode == "buffered" else []

    async def _request_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        chunk, end = bytes(body.body), body.end_of_stream
        if self.decided:  # routed at the headers: the body only passes
            return [echo_body(chunk, end)] if self.request_mode == "full_duplex" else [
                continue_body()]
        self.body += chunk
        if len(self.body) > self.state.max_body_bytes:
            self.state.m_requests.labels("refused").inc()
            self.decided = True
            return [immediate_error(413, f"request body is larger than "
                                    f"{self.state.max_body_bytes} bytes",
                                    code="body_too_large")]
        if not end and self.request_mode == "full_duplex":
            return []
        self.decided = True
        answer = await self._destination(bytes(self.body))
        if isinstance(answer, ext_proc.ProcessingResponse):
            return [answer]
        if self.request_mode == "buffered":
            return [routed(answer, phase="body")]
        sent = answer.body if answer.body is not None else bytes(self.body)
        return [routed(answer, phase="headers"), echo_body(sent, True)]

    async def _destination(self, raw: bytes | None) -> Destination | ext_proc.ProcessingResponse:
        """Where the request goes (the picker's choice for a completion with its body, else
        the ready replicas by name), or the refusal to answer instead."""
        state = self.state
        started = time.perf_counter()
        chat = COMPLETION_PATHS.get(self.path)
        try:
            if raw is not None and chat is not None and self.tenant is not None:
                body = parse_json(raw)
                if not isinstance(body, dict):
                    raise ApiError(400, "request body must be a JSON object, got "
                                   f"{type(body).__name__}", code="invalid_body")
                destination = await self._picked(body, chat)
            else:
                destination = self._any_ready()
        except ApiError as exc:
            state.m_requests.labels("refused").inc()
            return _refusal(exc)
        if destination is None:
            state.m_requests.labels("no_replica").inc()
            return immediate_error(503, "no replica is ready", code="no_replica",
                                   headers={"retry-after": "1"})
        state.m_pick.observe(time.perf_counter() - started)
        return destination

    async def _picked(self, body: dict[str, Any], chat: bool) -> Destination | None:
        state = self.state
        assert self.tenant is not None
        pick = await state.picker.pick(PickRequest(self.tenant, body, chat))
        if pick is None:
            return None
        replicas = state.view.replicas
        first = replicas.get(pick.replica)
        if first is None:
            return None
        # One body for every address Envoy may try: fallbacks serve with the pick's engine
        # (a kvfleet replica refuses vLLM's cache_salt, a vLLM replica needs it).
        targets = [t for t in pick.targets
                   if (r := replicas.get(t.replica)) is not None and r.engine == first.engine]
        new_body = state.tenancy.vllm_body(body, self.tenant) if first.engine == "vllm" else None
        state.picker.begin(pick.replica, pick.prompt_tokens)
        self.pick = pick
        state.m_requests.labels("picked").inc()
        return Destination(
            destination_addresses(targets[0].address, [t.address for t in targets[1:]]),
            {**self._tenant_headers([t.replica for t in targets]),
             "x-kvfleet-route": pick.reason},
            remove=self._removed(), body=new_body)

    def _any_ready(self) -> Destination | None:
        """Not a completion, or no body to read: the ready replicas by name (any serves it)."""
        state = self.state
        names = sorted(x.name for x in state.view.loads()
                       if x.ready and x.name in state.view.replicas)
        names = names[: 1 + state.max_fallbacks]
        if not names:
            return None
        state.m_requests.labels("routed").inc()
        addresses = [state.picker.address_of(n) for n in names]
        headers = self._tenant_headers(names) if self.tenant is not None else {}
        return Destination(destination_addresses(addresses[0], addresses[1:]), headers,
                           remove=self._removed())

    def _tenant_headers(self, replicas: list[str]) -> dict[str, str]:
        assert self.tenant is not None
        return self.state.tenancy.replica_headers(
            self.tenant, replicas=replicas, method=self.method, path=self.path, now_s=time.time())

    def _removed(self) -> list[str]:
        """The API key never goes on; a client's own assertion neither, when none is signed."""
        removed = ["authorization"]
        if self.state.router_secret is None:
            removed.append(ASSERTION_HEADER.lower())
        return removed

    # -- the answer --------------------------------------------------------------------------

    def _response_body(self, body: ext_proc.HttpBody) -> ext_proc.ProcessingResponse:
        chunk = bytes(body.body)
        self.tail += chunk
        if len(self.tail) > USAGE_TAIL_BYTES:
            del self.tail[: len(self.tail) - USAGE_TAIL_BYTES]
        if self.response_mode == "full_duplex":
            return echo_body(chunk, body.end_of_stream, response=True)
        return continue_body(response=True)


def _refusal(exc: ApiError) -> ext_proc.ProcessingResponse:
    return immediate_error(exc.status, exc.message, code=exc.code, param=exc.param,
                           headers={k.lower(): v for k, v in exc.headers.items()})


def usage_of(tail: bytes) -> dict[str, int] | None:
    """The `usage` of an OpenAI answer from its last bytes: a JSON answer's, or the last SSE
    event that has one; `prompt`, `cached` (`prompt_tokens_details.cached_tokens`) and
    `completion` tokens. None when the tail holds none."""
    text = tail.decode("utf-8", "replace").strip()
    candidates: list[str] = []
    if text.startswith("{"):
        candidates.append(text)
    candidates += [line[5:].strip() for line in reversed(text.splitlines())
                   if line.startswith("data:") and '"usage"' in line]
    for candidate in candidates:
        try:
            usage = json.loads(candidate).get("usage")
        except (ValueError, AttributeError):
            continue
        if not isinstance(usage, dict):
            continue
        details = usage.get("prompt_tokens_details") or {}
        out = {"prompt": usage.get("prompt_tokens"), "completion": usage.get("completion_tokens"),
               "cached": details.get("cached_tokens") if isinstance(details, dict) else None}
        return {k: v for k, v in out.items() if isinstance(v, int) and v >= 0}
    return None
