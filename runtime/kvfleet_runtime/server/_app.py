"""The replica HTTP server (aiohttp): OpenAI-compatible completions, cache control, probes, metrics.

Routes:
    POST /v1/completions      OpenAI-compatible; tenant from the `X-Kvfleet-Tenant` header
    GET  /v1/models           the one served model
    GET  /cache/stats         ?tenant=   hit rates, bytes, evictions, tier breakdown
    POST /cache/invalidate    {"model_version": "sha256:..."} -> 202
    GET  /metrics             Prometheus text format
    GET  /healthz, /readyz    liveness (the event loop answers), readiness (model loaded, serving)
    GET  /openapi.json        OpenAPI 3.1, generated from the pydantic request models

Every error is JSON, `{"error": {"message", "type", "param", "code"}}`, and names the problem;
bad input is a 4xx and never takes the server down. Only an internal bug gives a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
)
from pydantic import BaseModel, ValidationError

from kvfleet_runtime.cache import CacheConfig, KVLayout, PrefixCache
from kvfleet_runtime.configwatch import ConfigFileWatcher
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
    EngineOverloaded,
    Finished,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from kvfleet_runtime.model import LoadedModel, default_device, load_checkpoint
from kvfleet_runtime.server._auth import ReplicaAuth, auth_middleware
from kvfleet_runtime.server._config import ReplicaConfig, load_config, restart_fields
from kvfleet_runtime.server._schemas import (
    TENANT_PATTERN,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    InvalidateAccepted,
    InvalidateRequest,
)
from kvfleet_runtime.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvfleet_runtime.wire import TENANT_HEADER

__all__ = [
    "ApiError", "Replica", "apply_config", "build_replica", "create_app", "openapi_document",
]

log = logging.getLogger(__name__)

_TENANT_RE = re.compile(TENANT_PATTERN)
_HARD_MAX_BODY_BYTES = 64 << 20
"""aiohttp's own cap; the configured (live) limit is checked below it."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error",
                503: "overloaded_error"}


def _error_response(status: int, message: str, *, param: str | None = None,
                    code: str | None = None, headers: Mapping[str, str] | None = None
                    ) -> web.Response:
    body = {"error": {"message": message,
                      "type": _ERROR_TYPES.get(status, "server_error" if status >= 500
                                               else "invalid_request_error"),
                      "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


@dataclass(slots=True)
class Replica:
    """Everything a running replica holds; the app's handlers read it, the watcher updates it."""

    config: ReplicaConfig
    loaded: LoadedModel
    model_id: str
    engine: Engine
    cache: PrefixCache | None
    registry: CollectorRegistry
    config_path: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    """The model folder's own tokenizer (`load_tokenizer`): prompts, streamed text, stop ids."""
    ready: bool = False
    restart_pending: list[str] = field(default_factory=list)
    boot_config: ReplicaConfig | None = None
    """The config the replica started with; restart-only fields are compared against it, so a
    reload that passes through another value (a half-written file) reports only real drift."""
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    reloads: Counter | None = None
    before_submit: Callable[[str, list[int]], Awaitable[None]] | None = None
    """Set by the fleet tier (`kvfleet_runtime.fleet.wiring`): fetch the prompt's prefix from a
    peer before the engine looks it up. Never raises; on any failure the engine prefills."""


def build_replica(config: ReplicaConfig, *, config_path: Path | None = None,
                  overrides: Mapping[str, Any] | None = None,
                  registry: CollectorRegistry | None = None) -> Replica:
    """Load the model and build the cache and engine (no server yet)."""
    if not config.model_dir:
        raise ValueError("model_dir is not set (flag --model-dir, config file or "
                         "KVFLEET_REPLICA_MODEL_DIR)")
    device = default_device() if config.device == "auto" else torch.device(config.device)
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)
    # The tokenizer first: a folder we cannot tokenize for is refused before the weights load.
    tokenizer = load_tokenizer(Path(config.model_dir))
    # A refused config, a checkpoint that does not match it, or weights with another digest
    # than expected: ValueError naming the problem (the CLI prints it, no traceback).
    loaded = load_checkpoint(Path(config.model_dir), device=device, attn_impl=config.attn_impl,
                             dtype=config.dtype,
                             expected_digest=config.expected_weights_digest or None)
    if tokenizer.vocab_size > loaded.args.vocab_size:
        raise ValueError(f"{config.model_dir}: the tokenizer has {tokenizer.vocab_size} ids but "
                         f"the model's vocabulary has {loaded.args.vocab_size} (vocab_size in "
                         "config.json): the tokenizer is not this model's")
    model_id = config.model_id or Path(config.model_dir).resolve().name
    registry = registry or CollectorRegistry()
    args = loaded.args
    cache_cfg = config.cache
    cache = PrefixCache(
        CacheConfig(num_t0_blocks=cache_cfg.num_t0_blocks, num_t1_blocks=cache_cfg.num_t1_blocks,
                    admit_min_sightings=cache_cfg.admit_min_sightings,
                    store_queue_max_entries=cache_cfg.store_queue_max_entries),
        KVLayout(args.n_layers, args.n_kv_heads, args.head_dim, dtype=args.dtype),
        clock=time.monotonic,
        device=device,
        registry=registry,
    )
    e = config.engine
    engine = Engine(
        loaded.model,
        CacheKeyFields.for_model(loaded, model_id),
        cache=cache if cache_cfg.enabled else None,
        config=EngineConfig(num_kv_blocks=e.num_kv_blocks, max_batch_size=e.max_batch_size,
                            max_waiting=e.max_waiting,
                            prefill_chunks_per_step=e.prefill_chunks_per_step,
                            stop_ids=tokenizer.stop_ids),
        registry=registry,
    )
    return Replica(config=config, boot_config=config, loaded=loaded, model_id=model_id,
                   tokenizer=tokenizer,
                   engine=engine, cache=cache, registry=registry, config_path=config_path,
                   overrides=dict(overrides or {}),
                   reloads=Counter("kvfleet_replica_config_reloads", "Config file reloads.",
                                   ["result"], registry=registry))


# ---- config reload ---------------------------------------------------------------------------

def apply_config(replica: Replica, new: ReplicaConfig) -> list[str]:
    """Apply the live fields of `new`; returns the changed fields that need a restart."""
    pending = restart_fields(replica.boot_config or replica.config, new)
    e = new.engine
    replica.engine.config = dataclasses.replace(
        replica.engine.config, max_batch_size=e.max_batch_size, max_waiting=e.max_waiting,
        prefill_chunks_per_step=e.prefill_chunks_per_step)
    replica.engine.cache = replica.cache if new.cache.enabled else None
    replica.config = new
    replica.restart_pending = pending
    return pending


async def watch_config(replica: Replica) -> None:
    """Poll the config file; apply a changed, valid file; keep the last good config otherwise."""
    path = replica.config_path
    assert path is not None
    watcher = ConfigFileWatcher(path)  # settle-then-apply: a half-written file is never parsed
    while True:
        await asyncio.sleep(replica.config.config_poll_interval_s)
        if not watcher.poll():
            continue
        assert replica.reloads is not None
        try:
            new = load_config(path, overrides=replica.overrides)
        except ValueError as exc:
            replica.reloads.labels("rejected").inc()
            log.error("config reload rejected, keeping the last good config: %s", exc)
            continue
        pending = apply_config(replica, new)
        replica.reloads.labels("applied").inc()
        log.info("config reloaded from %s%s", path,
                 f"; needs a restart to apply: {', '.join(pending)}" if pending else "")



# ---- request helpers -------------------------------------------------------------------------

def _tenant(request: web.Request) -> str:
    tenant = request.headers.get(TENANT_HEADER)
    if not tenant:
        raise ApiError(400, f"missing header {TENANT_HEADER} (set by the router)",
                       param=TENANT_HEADER, code="missing_tenant")
    if not _TENANT_RE.match(tenant):
        raise ApiError(400, f"header {TENANT_HEADER} {tenant[:80]!r} does not match "
                       f"{TENANT_PATTERN}", param=TENANT_HEADER, code="invalid_tenant")
    return tenant


async def _json_body(request: web.Request, limit: int) -> Any:
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body of {request.content_length} bytes exceeds the limit "
                       f"of {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(1 << 16):
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc


M = TypeVar("M", bound=BaseModel)


def _validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"] if p not in ("text", "token_ids"))
            value = repr(err.get("input"))
            value = value if len(value) <= 60 else value[:57] + "..."
            problems.append(f"{loc or 'body'}: {err['msg']} (got {value})")
        first = exc.errors()[0]["loc"]
        raise ApiError(400, "; ".join(problems), param=str(first[0]) if first else None,
                       code="invalid_value") from exc


def _created() -> int:
    return int(time.time())


# ---- handlers --------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _handlers(replica: Replica) -> dict[str, Handler]:
    tok = replica.tokenizer

    async def completions(request: web.Request) -> web.StreamResponse:
        tenant = _tenant(request)
        limits = replica.config.limits
        body = _validate(CompletionRequest, await _json_body(request, limits.max_body_bytes))
        if body.model is not None and body.model != replica.model_id:
            raise ApiError(404, f"model {body.model[:80]!r} is not served here; this replica "
                           f"serves {replica.model_id!r}", param="model", code="model_not_found")
        if isinstance(body.prompt, str):
            # A cheap bound before encoding, exact for bytes only (one id per UTF-8 byte, plus
            # BOS); other tokenizers are checked on the ids below.
            if isinstance(tok, ByteTokenizer) and len(body.prompt) > limits.max_prompt_tokens - 1:
                raise ApiError(400, f"prompt has {len(body.prompt)} characters; the limit is "
                               f"{limits.max_prompt_tokens - 1}", param="prompt",
                               code="prompt_too_long")
            try:
                token_ids = tok.encode(body.prompt)
            except ValueError as exc:
                raise ApiError(400, f"prompt: {exc}", param="prompt",
                               code="invalid_value") from exc
        else:
            token_ids = list(body.prompt)
        if len(token_ids) > limits.max_prompt_tokens:
            raise ApiError(400, f"prompt has {len(token_ids)} tokens; the limit is "
                           f"{limits.max_prompt_tokens}", param="prompt", code="prompt_too_long")
        if body.max_tokens > limits.max_tokens:
            raise ApiError(400, f"max_tokens {body.max_tokens} exceeds the limit of "
                           f"{limits.max_tokens}", param="max_tokens", code="invalid_value")
        gen = GenerationRequest(tenant, tuple(token_ids), SamplingParams(
            max_tokens=body.max_tokens, temperature=body.temperature, seed=body.seed))
        try:
            replica.engine.check(gen)  # bad token ids never reach the fleet hook
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_value") from exc
        if replica.before_submit is not None:
            try:
                await replica.before_submit(tenant, token_ids)
            except Exception:  # a cache-side failure never fails the request: recompute
                log.exception("before_submit hook failed; the engine prefills instead")
        try:
            stream = replica.engine.submit(gen)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt", code="invalid_value") from exc
        except EngineOverloaded as exc:
            raise ApiError(503, f"replica overloaded: {exc}", code="overloaded",
                           headers={"Retry-After": "1"}) from exc
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _sse(request, replica, stream, rid, include_usage)
        out: list[int] = []
        fin: Finished | None = None
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    out.append(event.token_id)
                else:
                    fin = event
        finally:
            if fin is None:
                stream.cancel()
        assert fin is not None
        if fin.finish_reason == "error":
            raise ApiError(500, fin.error or "generation failed", code="generation_failed")
        resp = {
            "id": rid, "object": "text_completion", "created": _created(),
            "model": replica.model_id,
            "choices": [{"index": 0, "text": tok.decode(out), "logprobs": None,
                         "finish_reason": fin.finish_reason, "token_ids": out}],
            "usage": _usage(fin),
        }
        return web.json_response(resp, headers=_cache_headers(fin))

    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [
            {"id": replica.model_id, "object": "model", "created": 0, "owned_by": "kvfleet",
             "weights_digest": replica.loaded.weights_digest}]})

    async def cache_stats(request: web.Request) -> web.StreamResponse:
        extra = sorted(set(request.query) - {"tenant"})
        if extra:
            raise ApiError(400, f"unknown query parameter(s): {', '.join(extra)}",
                           param=extra[0], code="unknown_parameter")
        tenant = request.query.get("tenant")
        if tenant is not None and not _TENANT_RE.match(tenant):
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
        return web.json_response(data)

    async def invalidate(request: web.Request) -> web.StreamResponse:
        body = _validate(InvalidateRequest, await _json_body(
            request, replica.config.limits.max_body_bytes))
        cache = replica.cache
        if cache is not None:
            task = asyncio.create_task(asyncio.to_thread(cache.invalidate, body.model_version))
            replica.background.add(task)
            task.add_done_callback(replica.background.discard)
        return web.json_response(
            InvalidateAccepted(model_version=body.model_version).model_dump(), status=202)

    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.Response(body=generate_latest(replica.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def healthz(request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.StreamResponse:
        body = {"status": "ready" if replica.ready else "not_ready", "model": replica.model_id,
                "weights_digest": replica.loaded.weights_digest,
                "restart_pending": replica.restart_pending}
        return web.json_response(body, status=200 if replica.ready else 503)

    async def openapi(request: web.Request) -> web.StreamResponse:
        return web.json_response(openapi_document(replica))

    return {"completions": completions, "models": models, "cache_stats": cache_stats,
            "invalidate": invalidate, "metrics": metrics, "healthz": healthz, "readyz": readyz,
            "openapi": openapi}


def _usage(fin: Finished) -> dict[str, Any]:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}


def _cache_headers(fin: Finished) -> dict[str, str]:
    return {"X-Kvfleet-Cached-Tokens": str(fin.cached_tokens),
            "X-Kvfleet-Cache-Tier": fin.cache_tier or "none"}


async def _sse(request: web.Request, replica: Replica, stream: Any, rid: str,
               include_usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    decoder = replica.tokenizer.stream_decoder()
    created = _created()
    done = False

    def chunk(text: str, finish: str | None, token_ids: list[int]) -> bytes:
        data = {"id": rid, "object": "text_completion", "created": created,
                "model": replica.model_id,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish, "token_ids": token_ids}]}
        return f"data: {json.dumps(data)}\n\n".encode()

    try:
        await resp.prepare(request)
        async for event in stream:
            if isinstance(event, TokenEvent):
                await resp.write(chunk(decoder.push(event.token_id), None, [event.token_id]))
                continue
            done = True
            await resp.write(chunk(decoder.flush(), event.finish_reason, []))
            if include_usage:
                usage = {"id": rid, "object": "text_completion", "created": created,
                         "model": replica.model_id, "choices": [], "usage": _usage(event)}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    finally:
        if not done:
            stream.cancel()
    return resp


# ---- app -------------------------------------------------------------------------------------

@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                               headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else (
            f"{exc.reason}: {request.method} {request.path}")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error_response(exc.status, message, headers=headers)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(500, "internal error", code="internal_error")


def create_app(replica: Replica, *, watch: bool = True,
               auth: ReplicaAuth | None = None) -> web.Application:
    """The replica's app. `auth` None: no router secret (tenant `default` on loopback only)."""
    authenticate = auth_middleware(auth or ReplicaAuth(), _error_response)
    app = web.Application(middlewares=[_errors, authenticate],
                          client_max_size=_HARD_MAX_BODY_BYTES)
    h = _handlers(replica)
    app.router.add_post("/v1/completions", h["completions"])
    app.router.add_get("/v1/models", h["models"])
    app.router.add_get("/cache/stats", h["cache_stats"])
    app.router.add_post("/cache/invalidate", h["invalidate"])
    app.router.add_get("/metrics", h["metrics"])
    app.router.add_get("/healthz", h["healthz"])
    app.router.add_get("/readyz", h["readyz"])
    app.router.add_get("/openapi.json", h["openapi"])

    async def lifecycle(app: web.Application) -> Any:
        await replica.engine.start()
        watcher = None
        if watch and replica.config_path is not None:
            watcher = asyncio.create_task(watch_config(replica), name="kvfleet-config-watch")
        replica.ready = True
        yield
        replica.ready = False
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await replica.engine.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


# ---- OpenAPI ---------------------------------------------------------------------------------

def openapi_document(replica: Replica) -> dict[str, Any]:
    """OpenAPI 3.1 for this replica: schemas from the pydantic models, limits from the config."""
    components: dict[str, Any] = {}

    def ref(model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": ref(ErrorResponse)}}}

    def errors(*codes: int) -> dict[str, Any]:
        names = {400: "Invalid request", 401: "Not authenticated (docs/security.md)",
                 403: "Not allowed (docs/security.md)", 404: "Not found",
                 413: "Body too large", 503: "Overloaded, retry later"}
        return {str(c): {"description": names[c], **error} for c in codes}

    tenant_header = {"name": TENANT_HEADER, "in": "header", "required": True,
                     "description": "Tenant id, set by the router, with its assertion in "
                                    "X-Kvfleet-Tenant-Assertion (docs/security.md).",
                     "schema": {"type": "string", "pattern": TENANT_PATTERN}}
    completion = ref(CompletionRequest)
    _apply_limits(components["CompletionRequest"], replica)
    json_ok = {"application/json": {"schema": {"type": "object"}}}
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "kvfleet replica", "version": "1",
                 "description": f"Serves {replica.model_id} "
                                f"({replica.loaded.weights_digest})."},
        "paths": {
            "/v1/completions": {"post": {
                "summary": "Create a completion (OpenAI-compatible)",
                "operationId": "createCompletion",
                "parameters": [tenant_header],
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": completion}}},
                "responses": {
                    "200": {"description": "The completion, or server-sent events when streaming",
                            "content": {"application/json": {"schema": ref(CompletionResponse)},
                                        "text/event-stream": {"schema": _SSE_EVENT}}},
                    **errors(400, 401, 403, 404, 413, 503),
                },
            }},
            "/v1/models": {"get": {"summary": "The served model", "operationId": "listModels",
                                   "responses": {"200": {"description": "Models",
                                                         "content": json_ok}}}},
            "/cache/stats": {"get": {
                "summary": "Cache statistics, for one tenant or all",
                "operationId": "cacheStats",
                "parameters": [{"name": "tenant", "in": "query", "required": False,
                                "schema": {"type": "string", "pattern": TENANT_PATTERN}}],
                "responses": {"200": {"description": "Stats", "content": json_ok},
                              **errors(400, 401, 403)},
            }},
            "/cache/invalidate": {"post": {
                "summary": "Drop every cache entry of a weights version",
                "operationId": "invalidateCache",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": ref(InvalidateRequest)}}},
                "responses": {"202": {"description": "Accepted", "content": {
                    "application/json": {"schema": ref(InvalidateAccepted)}}},
                    **errors(400, 401, 403, 413)},
            }},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                                 "responses": {"200": {"description": "Text format",
                                                       "content": {"text/plain": {
                                                           "schema": {"type": "string"}}}}}}},
            "/healthz": {"get": {"summary": "Liveness", "operationId": "healthz",
                                 "responses": {"200": {"description": "Alive",
                                                       "content": json_ok}}}},
            "/readyz": {"get": {"summary": "Readiness", "operationId": "readyz",
                                "responses": {"200": {"description": "Ready",
                                                      "content": json_ok},
                                              "503": {"description": "Not ready",
                                                      "content": json_ok}}}},
        },
        "components": {"schemas": components},
    }
    return doc


_SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` is a JSON completion chunk, or `[DONE]` last.",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


def _apply_limits(schema: dict[str, Any], replica: Replica) -> None:
    limits, args = replica.config.limits, replica.loaded.args
    props = schema["properties"]
    props["model"] = {"anyOf": [{"type": "string", "enum": [replica.model_id]}, {"type": "null"}],
                      "default": None, "description": "The served model's id."}
    props["max_tokens"]["maximum"] = limits.max_tokens
    for branch in props["prompt"].get("oneOf", props["prompt"].get("anyOf", [])):
        if branch.get("type") == "string" and isinstance(replica.tokenizer, ByteTokenizer):
            branch["maxLength"] = limits.max_prompt_tokens - 1
        elif branch.get("type") == "array":
            branch["maxItems"] = limits.max_prompt_tokens
            branch["items"]["maximum"] = args.vocab_size - 1
