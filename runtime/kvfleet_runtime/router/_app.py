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

A replica that cannot be reached, or answers 503 before any byte was sent to the client, is
skipped and the request goes to the next replica of the pick's failover order (what deciding
again without it chooses; at most `max_attempts` replicas). A client
that goes away is a `client_abort` outcome (the upstream request is closed, so the replica
cancels the sequence), never a broken replica and never an ERROR log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)

from kvfleet_runtime import __version__
from kvfleet_runtime.affinity import ApiKeyMap
from kvfleet_runtime.api import (
    ApiError,
    ListenerLimits,
    error_body,
    error_middleware,
    error_response,
    handler_args,
    is_client_gone,
    one_line,
    parse_json,
    read_body,
)
from kvfleet_runtime.fleet.hint_index import HintIndex
from kvfleet_runtime.picker import FleetView, KvEventViews, Picker, PickRequest, Target, Tenancy
from kvfleet_runtime.pools import UPSTREAM_MAX_CONNECTIONS, UPSTREAM_MAX_CONNECTIONS_PER_REPLICA
from kvfleet_runtime.tokenizer import Tokenizer
from kvfleet_runtime.wire import TENANT_HEADER

__all__ = ["RouterState", "create_router_app"]

log = logging.getLogger(__name__)

_FORWARD_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "Retry-After")
_HARD_MAX_BODY_BYTES = 64 << 20
"""aiohttp's own cap; `RouterState.max_body_bytes` is checked below it."""
_PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}")


@dataclass
class RouterState:
    view: FleetView
    keys: ApiKeyMap
    index: HintIndex | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    max_hint_blocks: int = 512
    max_attempts: int = 3
    upstream_connect_timeout_s: float = 1.0
    upstream_timeout_s: float = 600.0
    """Longest a proxied request may take in all (a stream included)."""
    upstream_first_byte_timeout_s: float = 60.0
    """A replica must answer (a non-streamed answer whole, a stream its first token) within
    this, or the request fails over and the replica is kept out for `replica_backoff_s`:
    nginx's `proxy_read_timeout`. A non-streamed generation longer than this needs a larger
    value (or `stream: true`)."""
    upstream_read_timeout_s: float = 60.0
    """Once a stream's first token is out: the longest gap between two reads before the stream
    is ended with an error event (nginx's `proxy_read_timeout`)."""
    replica_backoff_s: float = 30.0
    """How long a replica that took its request and did not answer (or answered a non-JSON 5xx)
    stays out of decisions, whatever its load reports say: Envoy's outlier detection
    `base_ejection_time`."""
    max_body_bytes: int = 1 << 20
    """Larger bodies are refused with 413 before anything is forwarded (the replicas' default)."""
    body_read_timeout_s: float = 10.0
    """A body must arrive within this time, or the request is refused with 408."""
    header_read_timeout_s: float = ListenerLimits().header_timeout_s
    """A request head must be complete within this; also the idle keep-alive time
    (`api.ListenerLimits`)."""
    spill_window: int = 1000
    poll_interval_s: float = 0.5
    config_poll_s: float = 1.0
    session: aiohttp.ClientSession | None = None
    upstream_max_connections: int = UPSTREAM_MAX_CONNECTIONS
    upstream_max_connections_per_replica: int = UPSTREAM_MAX_CONNECTIONS_PER_REPLICA
    """The caps of the upstream pool the router makes (not of a `session` given to it)."""
    tokenizer: Tokenizer | None = None
    """The model's tokenizer (`kvfleet router --tokenizer DIR`), for text prompts; used only while
    the replicas report the same tokenizer name."""
    router_secret: bytes | None = None
    """Signs the tenant assertion sent with every proxied request (`kvfleet_runtime.auth`);
    None: the tenant goes unsigned and only replicas without a router secret (tenant `default`,
    loopback) accept it."""
    kv_events: KvEventViews | None = None
    """What each vLLM replica holds in its own KV cache, from its KV events (None: not
    subscribed); the cache-aware override takes the larger of this and the hint index."""
    kv_event_endpoints: dict[str, str] = field(default_factory=dict)
    """Replica name -> ZMQ endpoint of its KV events (`--kv-events`)."""
    kv_events_port: int | None = None
    """Every vLLM replica's events at its URL's host on this port (`--kv-events-port`)."""

    def __post_init__(self) -> None:
        if not 1 <= self.upstream_max_connections_per_replica <= self.upstream_max_connections:
            raise ValueError(
                "upstream connection caps: need 1 <= per replica "
                f"({self.upstream_max_connections_per_replica}) <= total "
                f"({self.upstream_max_connections})")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        r = self.registry
        # The composition: one secret signs the assertion, the body's salt and the KV views'.
        self.tenancy = Tenancy(self.keys, self.router_secret)
        self.view.set_tenants(self.keys.tenants)
        self.picker = Picker(
            self.view, index=self.index, kv_events=self.kv_events, tokenizer=self.tokenizer,
            router_secret=self.router_secret, kv_event_endpoints=self.kv_event_endpoints,
            kv_events_port=self.kv_events_port, max_hint_blocks=self.max_hint_blocks,
            max_fallbacks=self.max_attempts - 1, spill_window=self.spill_window, registry=r)
        self.m_requests = Counter(
            "kvfleet_router_requests",
            "Proxied requests by replica and outcome.",
            ["replica", "outcome"],
            registry=r,
        )
        self.m_overhead = Histogram(
            "kvfleet_router_overhead_seconds",
            "Time from request arrival to the upstream request being sent (auth, parse, hint "
            "lookup, decision).",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1),
            registry=r,
        )
        self.m_unauthorized = Counter(
            "kvfleet_router_unauthorized",
            "Requests refused for a missing or unknown API key.",
            registry=r,
        )

    @property
    def spill_rate(self) -> float:
        return self.picker.spill_rate


def _error(
    status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> web.Response:
    return error_response(status, message, code=code, headers=headers)


def create_router_app(state: RouterState) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware(log)], client_max_size=_HARD_MAX_BODY_BYTES,
        handler_args=handler_args(ListenerLimits(header_timeout_s=state.header_read_timeout_s)),
    )

    def authenticate(request: web.Request) -> str:
        try:
            return state.tenancy.authenticate(request.headers.get("Authorization"))
        except ApiError:
            state.m_unauthorized.inc()
            raise

    async def json_body(request: web.Request) -> tuple[bytes, dict[str, Any]]:
        raw = await read_body(request, state.max_body_bytes, state.body_read_timeout_s)
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise ApiError(
                400,
                f"request body must be a JSON object, got {type(body).__name__}",
                code="invalid_body",
            )
        return raw, body

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _proxy(request, "/v1/completions", chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        # The replicas' chat template, when the picker has their tokenizer (chat_token_ids).
        return await _proxy(request, "/v1/chat/completions", chat=True)

    async def _proxy(request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
        started = time.perf_counter()
        tenant = authenticate(request)
        raw, body = await json_body(request)
        assert state.session is not None
        pick = await state.picker.pick(PickRequest(tenant, body, chat))
        last_error = "no replica is ready"
        salted: bytes | None = None
        for target in pick.targets if pick is not None else ():
            name = target.replica
            replica = state.view.replicas[name]
            data = raw
            if replica.engine == "vllm":
                if salted is None:
                    salted = state.tenancy.vllm_body(body, tenant)
                data = salted
            headers = {"Content-Type": "application/json",
                       **state.tenancy.replica_headers(tenant, replica=name, method="POST",
                                                       path=path, now_s=time.time())}
            assert pick is not None
            state.picker.begin(name, pick.prompt_tokens)
            state.m_overhead.observe(time.perf_counter() - started)
            attempt = _Attempt(name, target)
            try:
                return await _attempt(request, replica.url + path, data, headers, attempt)
            except _Failover as exc:
                state.m_requests.labels(name, exc.outcome).inc()
                if exc.back_off:
                    state.picker.mark_down(name, backoff_s=state.replica_backoff_s)
                    log.warning("replica %s: %s; marked down for %g s", name, exc.detail,
                                state.replica_backoff_s)
                elif exc.outcome == "unreachable":
                    state.picker.mark_down(name)
                last_error = f"replica {name}: {exc.detail}"
                continue
            except _ClientGone:
                state.m_requests.labels(name, "client_abort").inc()
                log.debug("client went away; closed the request to replica %s", name)
                assert attempt.out is not None
                return attempt.out
            except asyncio.CancelledError:
                # The client went away (handler cancellation), waiting for the replica or
                # mid-answer: the upstream request is closed, and the replica cancels.
                state.m_requests.labels(name, "client_abort").inc()
                log.debug("client went away; closed the request to replica %s", name)
                raise
            finally:
                state.picker.end(name, pick.prompt_tokens)
        return _error(503, last_error, "no_replica", {"Retry-After": "1"})

    async def _attempt(request: web.Request, url: str, data: bytes, headers: dict[str, str],
                       attempt: _Attempt) -> web.StreamResponse:
        """One replica's try. Raises `_Failover` while nothing went to the client (the caller
        tries the next replica); once the answer started, a failure ends it in the stream."""
        assert state.session is not None
        loop = asyncio.get_running_loop()
        first_byte_by = loop.time() + state.upstream_first_byte_timeout_s
        timeout = aiohttp.ClientTimeout(total=state.upstream_timeout_s,
                                        sock_connect=state.upstream_connect_timeout_s)
        try:
            upstream = await asyncio.wait_for(
                state.session.post(url, data=data, headers=headers, timeout=timeout),
                state.upstream_first_byte_timeout_s)
        except TimeoutError:
            raise _Failover("first_byte_timeout", "no answer within "
                            f"{state.upstream_first_byte_timeout_s:g} s", back_off=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _Failover("unreachable", f"unreachable ({type(exc).__name__})") from None
        # Closing (not releasing) on every path out: a request that did not finish is how the
        # replica learns to cancel its sequence.
        try:
            if upstream.status == 503:
                raise _Failover("overloaded", "overloaded")
            kind = upstream.headers.get("Content-Type", "")
            if upstream.status >= 500 and not kind.startswith("application/json"):
                raise _Failover("bad_gateway", f"HTTP {upstream.status} that is not JSON "
                                f"({one_line(kind or 'no content type', 60)})", back_off=True)
            if upstream.status == 200 and kind.startswith("text/event-stream"):
                return await _relay_stream(request, upstream, attempt, first_byte_by)
            try:
                answer = await asyncio.wait_for(upstream.read(),
                                                max(0.0, first_byte_by - loop.time()))
            except TimeoutError:
                raise _Failover("first_byte_timeout", "answer not complete within "
                                f"{state.upstream_first_byte_timeout_s:g} s",
                                back_off=True) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise _Failover("broken", f"answer cut ({type(exc).__name__})",
                                back_off=True) from None
            resp = web.Response(status=upstream.status, body=answer,
                                headers=_answer_headers(upstream, attempt.decision))
            state.m_requests.labels(attempt.name, str(upstream.status)).inc()
            return resp
        finally:
            upstream.close()

    async def _relay_stream(request: web.Request, upstream: aiohttp.ClientResponse,
                            attempt: _Attempt, first_byte_by: float) -> web.StreamResponse:
        """SSE: events are held back until one carries a token (or the end), so a replica that
        fails before its first token is failed over like a non-streamed request; after that, a
        cut is an error event in the stream (OpenAI's shape), never a silent close."""
        loop = asyncio.get_running_loop()
        held: list[bytes] = []
        pending = b""
        while True:
            left_s = first_byte_by - loop.time()
            try:
                if left_s <= 0:
                    raise TimeoutError
                chunk = await asyncio.wait_for(upstream.content.readany(), left_s)
            except TimeoutError:
                raise _Failover("first_byte_timeout", "no token within "
                                f"{state.upstream_first_byte_timeout_s:g} s",
                                back_off=True) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise _Failover("broken", f"stream cut before its first token "
                                f"({type(exc).__name__})", back_off=True) from None
            if not chunk:
                raise _Failover("broken", "stream ended before its first token", back_off=True)
            held.append(chunk)
            pending += chunk
            if _has_token(pending) or len(pending) > _MAX_HELD_STREAM_BYTES:
                break
            pending = pending[pending.rfind(b"\n\n") + 2:] if b"\n\n" in pending else pending
        resp = web.StreamResponse(status=200, headers=_answer_headers(upstream, attempt.decision))
        attempt.out = resp
        await _client_write(resp.prepare(request))
        for chunk in held:
            await _client_write(resp.write(chunk))
        while True:
            try:
                chunk = await asyncio.wait_for(upstream.content.readany(),
                                               state.upstream_read_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                why = (f"no data for {state.upstream_read_timeout_s:g} s"
                       if isinstance(exc, TimeoutError) else type(exc).__name__)
                state.m_requests.labels(attempt.name, "broken").inc()
                log.warning("replica %s failed mid-stream (%s); ending the stream with an "
                            "error event", attempt.name, why)
                event = error_body(502, f"the replica failed mid-stream ({why}); the answer "
                                   "is incomplete", code="upstream_failed")
                with contextlib.suppress(Exception):
                    await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                    await resp.write_eof()
                return resp
            if not chunk:
                break
            await _client_write(resp.write(chunk))
        await _client_write(resp.write_eof())
        state.m_requests.labels(attempt.name, "200").inc()
        return resp

    async def from_a_replica(path: str) -> web.Response:
        """GET `path` from the first ready replica that answers with JSON."""
        assert state.session is not None
        for load in sorted(state.view.loads(), key=lambda x: x.name):
            if not load.ready:
                continue
            url = state.view.replicas[load.name].url + path
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with state.session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return web.json_response(await r.json(), status=r.status)
        raise ApiError(503, "no replica is ready", code="no_replica", headers={"Retry-After": "1"})

    async def tokenizer_route(request: web.Request) -> web.StreamResponse:
        """vLLM's /tokenize and /detokenize, answered by the first ready replica: every
        replica of a fleet serves the same model, so any one's tokenizer is the model's."""
        authenticate(request)
        raw, _ = await json_body(request)
        assert state.session is not None
        for load in sorted(state.view.loads(), key=lambda x: x.name):
            if not load.ready:
                continue
            url = state.view.replicas[load.name].url + request.path
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with state.session.post(
                    url, data=raw, headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=30)) as r:
                    return web.json_response(await r.json(), status=r.status)
        raise ApiError(503, "no replica is ready", code="no_replica", headers={"Retry-After": "1"})

    async def version(request: web.Request) -> web.StreamResponse:
        return web.json_response({"version": __version__})

    async def health(request: web.Request) -> web.StreamResponse:
        # vLLM's probe: an empty 200 while the router can place a request on some replica.
        return web.Response(status=200 if any(x.ready for x in state.view.loads()) else 503)

    async def models(request: web.Request) -> web.StreamResponse:
        authenticate(request)
        return await from_a_replica("/v1/models")

    async def model(request: web.Request) -> web.StreamResponse:
        authenticate(request)
        return await from_a_replica("/v1/models/" + quote(request.match_info["model"], safe=""))

    async def openapi(request: web.Request) -> web.StreamResponse:
        doc = await from_a_replica("/openapi.json")
        assert doc.text is not None
        return web.json_response(router_openapi(json.loads(doc.text)))

    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=generate_latest(state.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def healthz(request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.StreamResponse:
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
            },
            status=200 if ok else 503,
        )

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/tokenize", tokenizer_route)
    app.router.add_post("/detokenize", tokenizer_route)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.cleanup_ctx.append(_lifecycle(state))
    return app


@dataclass(slots=True)
class _Attempt:
    name: str
    decision: Target
    out: web.StreamResponse | None = None
    """The client's response once it started (nothing can be retried after that)."""


class _Failover(Exception):
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


def _has_token(pending: bytes) -> bool:
    """Whether one of the complete SSE events in `pending` carries a token, a finish, an error
    or the end: once it goes to the client, the answer is committed."""
    for event in pending.split(b"\n\n")[:-1]:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
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


def _answer_headers(upstream: aiohttp.ClientResponse, decision: Target) -> dict[str, str]:
    headers = {h: upstream.headers[h] for h in _FORWARD_RESPONSE_HEADERS if h in upstream.headers}
    headers.update(
        {h: v for h, v in upstream.headers.items() if h.lower().startswith("x-kvfleet-")})
    headers["X-Kvfleet-Replica"] = decision.replica
    headers["X-Kvfleet-Route"] = decision.reason
    return headers


async def _client_write(step: Awaitable[Any]) -> None:
    """A write to the client; one that went away raises `_ClientGone`."""
    try:
        await step
    except Exception as exc:
        if is_client_gone(exc):
            raise _ClientGone from exc
        raise


class _ClientGone(Exception):
    """The client closed its connection while the answer was being sent."""


def router_openapi(replica_doc: dict[str, Any]) -> dict[str, Any]:
    """The router's OpenAPI: the replicas' OpenAI operations (their schemas and limits), with
    the router's API-key auth instead of the tenant header, and the router's own probes."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    json_ok = {"application/json": {"schema": {"type": "object"}}}
    paths: dict[str, Any] = {}
    for path in _PROXIED_PATHS:
        if path not in replica_doc.get("paths", {}):
            continue
        ops = json.loads(json.dumps(replica_doc["paths"][path]))
        for op in ops.values():
            params = [p for p in op.get("parameters", []) if p.get("name") != TENANT_HEADER]
            op["parameters"] = params
            op["security"] = [{"apiKey": []}]
            op["responses"]["401"] = {"description": "Missing or unknown API key",
                                      "content": error}
            op["responses"]["503"] = {"description": "No replica can answer now; retry",
                                      "content": error}
            if "requestBody" in op:
                op["responses"]["408"] = {"description": "Body not received in time",
                                          "content": error}
                op["responses"]["413"] = {"description": "Body too large", "content": error}
        paths[path] = ops
    paths["/healthz"] = {"get": {"operationId": "healthz", "summary": "Liveness",
                                 "responses": {"200": {"description": "Alive",
                                                       "content": json_ok}}}}
    paths["/readyz"] = {"get": {"operationId": "readyz", "summary": "Readiness",
                                "responses": {"200": {"description": "Ready", "content": json_ok},
                                              "503": {"description": "Not ready",
                                                      "content": json_ok}}}}
    paths["/metrics"] = {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "Text format", "content": {
                                     "text/plain": {"schema": {"type": "string"}}}}}}}
    components = json.loads(json.dumps(replica_doc.get("components", {})))
    components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    info = dict(replica_doc.get("info", {}))
    info["title"] = "kvfleet router"
    return {"openapi": replica_doc.get("openapi", "3.1.0"), "info": info, "paths": paths,
            "components": components}


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
        assert state.session is not None
        await state.picker.start(state.session, poll_interval_s=state.poll_interval_s,
                                 config_poll_s=state.config_poll_s)
        yield
        await state.picker.stop()
        if own_session:
            await state.session.close()
            state.session = None

    return ctx
