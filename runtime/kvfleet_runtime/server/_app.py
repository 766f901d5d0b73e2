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
gives a 500. The OpenAI endpoints themselves live in `server/_completions.py`; what a running
replica holds (`Replica`), in `_state.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
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
from prometheus_client.metrics_core import Metric
from pydantic import BaseModel, ValidationError

from kvfleet_runtime import __version__
from kvfleet_runtime.api import (
    PROMPT_TAGS,
    ApiError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorResponse,
    ListenerLimits,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_middleware,
    error_response,
    handler_args,
    read_json,
    refused_fields,
)
from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache
from kvfleet_runtime.config.watch import ConfigFileWatcher
from kvfleet_runtime.engine import (
    CacheKeyFields,
    Engine,
    EngineConfig,
)
from kvfleet_runtime.model import (
    PagedKV,
    default_device,
    load_checkpoint,
    onednn_packing_supported,
)
from kvfleet_runtime.nvme import NvmeConfig, NvmeStore, NvmeTier
from kvfleet_runtime.server._auth import DEFAULTED_TENANT, ReplicaAuth, auth_middleware
from kvfleet_runtime.server._completions import (
    answer,
    chat_completions,
    completions,
    detokenize,
    tokenize,
)
from kvfleet_runtime.server._config import (
    CacheSettings,
    Limits,
    ReplicaConfig,
    load_config,
    restart_fields,
)
from kvfleet_runtime.server._schemas import (
    TENANT_PATTERN,
    InvalidateAccepted,
    InvalidateRequest,
)
from kvfleet_runtime.server._state import Replica
from kvfleet_runtime.server._tiers import invalidate_local
from kvfleet_runtime.tokenizer import ByteTokenizer, load_tokenizer
from kvfleet_runtime.wire import TENANT_HEADER

__all__ = [
    "Replica", "apply_config", "build_replica", "create_app", "openapi_document",
]

log = logging.getLogger(__name__)

_TENANT_RE = re.compile(TENANT_PATTERN)
_HARD_MAX_BODY_BYTES = 64 << 20
"""aiohttp's own cap; the configured (live) limit is checked below it."""


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
    model = loaded.model
    if config.pack_weights and onednn_packing_supported(device, model.embed_tokens.weight.dtype):
        model.pack_linear_weights()
    if tokenizer.vocab_size > loaded.args.vocab_size:
        raise ValueError(f"{config.model_dir}: the tokenizer has {tokenizer.vocab_size} ids but "
                         f"the model's vocabulary has {loaded.args.vocab_size} (vocab_size in "
                         "config.json): the tokenizer is not this model's")
    model_id = config.model_id or Path(config.model_dir).resolve().name
    registry = registry or CollectorRegistry()
    args = loaded.args
    cache_cfg = config.cache
    e = config.engine
    # One block pool per device: the engine's KV is the cache's T0 (cached prefixes and
    # in-flight sequences compete for the same blocks). Always bound, so that T0 can be turned
    # on and off live (`cache.t0_enabled`, the fleet config's `tiers.t0_device`).
    kv = PagedKV.allocate(args, e.num_kv_blocks, device=device)
    cache = PrefixCache(
        CacheTuning(num_t0_blocks=e.num_kv_blocks,
                    num_t1_blocks=cache_cfg.num_t1_blocks,
                    admit_min_sightings=cache_cfg.admit_min_sightings,
                    store_queue_max_entries=cache_cfg.store_queue_max_entries),
        KVLayout(args.n_layers, args.n_kv_heads, args.head_dim, dtype=args.dtype),
        clock=time.monotonic,
        device=device,
        registry=registry,
        device_kv=kv,
    )
    if not cache_cfg.t0_enabled:
        cache.set_t0_enabled(False)
    engine = Engine(
        loaded.model,
        CacheKeyFields.for_model(loaded, model_id, deterministic=config.engine.deterministic),
        cache=cache if cache_cfg.enabled else None,
        config=EngineConfig(num_kv_blocks=e.num_kv_blocks, max_batch_size=e.max_batch_size,
                            max_waiting=e.max_waiting,
                            max_tokens_per_step=e.max_tokens_per_step,
                            deterministic=e.deterministic,
                            stop_ids=tokenizer.stop_ids),
        registry=registry,
        kv=kv,
    )
    nvme = _build_nvme(cache, cache_cfg, registry)
    replica = Replica(config=config, boot_config=config, loaded=loaded, model_id=model_id,
                      tokenizer=tokenizer, nvme=nvme,
                      engine=engine, cache=cache, registry=registry, config_path=config_path,
                      overrides=dict(overrides or {}),
                      reloads=Counter("kvfleet_replica_config_reloads", "Config file reloads.",
                                      ["result"], registry=registry))
    replica.wire_tiers()
    return replica


def _build_nvme(cache: PrefixCache, settings: CacheSettings,
                registry: CollectorRegistry) -> NvmeTier | None:
    """T3 on the configured path, or None (not configured, or the path cannot hold it: the
    reason is logged and the replica serves without T3, which only costs recompute)."""
    if not settings.nvme_path or not settings.nvme_capacity_bytes:
        return None
    block = cache.layout.bytes_per_block
    if settings.nvme_capacity_bytes < block:
        raise ValueError(f"cache.nvme_capacity_bytes {settings.nvme_capacity_bytes} is smaller "
                         f"than one KV block of this model ({block} bytes)")
    store = NvmeStore.open(NvmeConfig(Path(settings.nvme_path), settings.nvme_capacity_bytes,
                                      block))
    if store is None:
        return None
    tier = NvmeTier(cache, store, mode=settings.nvme_mode,
                    min_sightings=settings.nvme_min_sightings, registry=registry)
    tier.start()
    return tier


# ---- config reload ---------------------------------------------------------------------------

def apply_config(replica: Replica, new: ReplicaConfig) -> list[str]:
    """Apply the live fields of `new`; returns the changed fields that need a restart. May copy
    (T0 off drains it): run it off the event loop."""
    pending = restart_fields(replica.boot_config or replica.config, new)
    e = new.engine
    replica.engine.config = dataclasses.replace(
        replica.engine.config, max_batch_size=e.max_batch_size, max_waiting=e.max_waiting,
        max_tokens_per_step=e.max_tokens_per_step)
    replica.engine.cache = replica.cache if new.cache.enabled else None
    if replica.nvme is not None and new.cache.nvme_mode != replica.config.cache.nvme_mode:
        replica.nvme.set_mode(new.cache.nvme_mode)
    replica.config = new
    replica.sync_t0()
    replica.restart_pending = pending
    return pending


async def watch_config(replica: Replica) -> None:
    """Poll the config file; apply a changed, valid file at the first poll that sees it; keep
    the last good config otherwise (`config.watch`: a half-written file is never applied)."""
    path = replica.config_path
    assert path is not None and replica.reloads is not None
    if replica.config_watcher is None:
        replica.config_watcher = ConfigFileWatcher(path)
    watcher = replica.config_watcher
    while True:
        await asyncio.sleep(replica.config.config_poll_interval_s)
        content = await asyncio.to_thread(watcher.poll)
        replica.config_polls = watcher.num_polls
        if content is None:
            if not watcher.error:
                replica.config_errors.pop("replica", None)
            continue
        try:
            # Off the event loop: a file at the parser's bounds takes a while to refuse.
            new = await asyncio.to_thread(load_config, path, overrides=replica.overrides,
                                          content=content)
        except (ValueError, RecursionError, MemoryError) as exc:
            watcher.reject(content, str(exc))
            replica.reloads.labels("rejected").inc()
            replica.config_errors["replica"] = watcher.error
            log.log(logging.DEBUG if watcher.repeated else logging.ERROR,
                    "config reload rejected, keeping the last good config: %s", watcher.error)
            continue
        pending = await asyncio.to_thread(apply_config, replica, new)
        replica.config_errors.pop("replica", None)
        watcher.accept(content)
        replica.config_applied_at_poll = watcher.applied_at_poll
        replica.reloads.labels("applied").inc()
        log.info("config reloaded from %s%s", path,
                 f"; needs a restart to apply: {', '.join(pending)}" if pending else "")



# ---- request helpers -------------------------------------------------------------------------

def _tenant(request: web.Request) -> str:
    tenant = request.get(DEFAULTED_TENANT) or request.headers.get(TENANT_HEADER)
    if not tenant:
        raise ApiError(400, f"missing header {TENANT_HEADER} (set by the router)",
                       param=TENANT_HEADER, code="missing_tenant")
    if not _TENANT_RE.match(tenant):
        raise ApiError(400, f"header {TENANT_HEADER} {tenant[:80]!r} does not match "
                       f"{TENANT_PATTERN}", param=TENANT_HEADER, code="invalid_tenant")
    return tenant


async def _json_body(request: web.Request, limits: Limits) -> Any:
    return await read_json(request, limits.max_body_bytes, limits.body_read_timeout_s)


M = TypeVar("M", bound=BaseModel)


def _validate(model: type[M], data: Any, *, generation: bool = True) -> M:
    """`generation` False (the tokenizer routes): only the model's own fields are checked."""
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_body")
    refused = refused_fields(data) if generation else []
    if refused:
        raise ApiError(400, "; ".join(f"{name}: {why}" for name, why in refused),
                       param=refused[0][0], code="unsupported_parameter")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # One problem per field: a union's members each fail ("greater than or equal to 1",
        # "-1") and are joined with "or", under the client's field name.
        problems: dict[str, tuple[list[str], str]] = {}
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
            value = repr(err.get("input"))
            value = value if len(value) <= 60 else value[:57] + "..."
            messages, _ = problems.setdefault(loc or "body", ([], value))
            if err["msg"] not in messages:
                messages.append(err["msg"])
        first = exc.errors()[0]["loc"]
        raise ApiError(400, "; ".join(f"{loc}: {' or '.join(msgs)} (got {value})"
                                      for loc, (msgs, value) in problems.items()),
                       param=str(first[0]) if first else None, code="invalid_value") from exc


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|constrained-[a-z]+|[a-z][a-z-]*\[.*\])$")
"""pydantic's names for a union's members (`literal[-1]`, `constrained-int`,
`function-before[_integral(), constrained-int]`); a field name has no brackets or dashes."""


def _is_union_tag(part: int | str) -> bool:
    """pydantic names the union member in an error's location; the client's field does not."""
    return isinstance(part, str) and (part in PROMPT_TAGS or bool(_UNION_TAG.match(part)))


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
        tenant = _tenant(request)
        data = await _json_body(request, replica.config.limits)
        return await completions(replica, request, tenant, _validate(CompletionRequest, data))

    async def chat_handler(request: web.Request) -> web.StreamResponse:
        tenant = _tenant(request)
        data = await _json_body(request, replica.config.limits)
        return await chat_completions(replica, request, tenant,
                                      _validate(ChatCompletionRequest, data))

    def card() -> ModelCard:
        return ModelCard(id=replica.model_id, created=0, owned_by="kvfleet",
                         root=replica.config.model_dir,
                         max_model_len=replica.loaded.args.max_seq_len,
                         weights_digest=replica.loaded.weights_digest,
                         object="model", parent=None, permission=[])

    async def tokenize_handler(request: web.Request) -> web.StreamResponse:
        data = await _json_body(request, replica.config.limits)
        body: TokenizeCompletionRequest | TokenizeChatRequest
        if isinstance(data, dict) and "messages" in data:
            body = _validate(TokenizeChatRequest, data, generation=False)
        else:
            body = _validate(TokenizeCompletionRequest, data, generation=False)
        return answer(await asyncio.to_thread(tokenize, replica, body))

    async def detokenize_handler(request: web.Request) -> web.StreamResponse:
        body = _validate(DetokenizeRequest, await _json_body(request, replica.config.limits),
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
        data["t0_enabled"] = cache.t0_enabled
        data["t1_enabled"] = cache.t1_enabled
        return web.json_response(data)

    async def invalidate(request: web.Request) -> web.StreamResponse:
        body = _validate(InvalidateRequest, await _json_body(request, replica.config.limits))
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
                 405: "Method not allowed", 408: "Body not received in time",
                 413: "Body too large", 503: "Overloaded, retry later"}
        return {str(c): {"description": names[c], **error} for c in codes}

    tenant_header = {"name": TENANT_HEADER, "in": "header", "required": True,
                     "description": "Tenant id, set by the router, with its assertion in "
                                    "X-Kvfleet-Tenant-Assertion (docs/security.md).",
                     "schema": {"type": "string", "pattern": TENANT_PATTERN}}

    def generate(summary: str, op: str, request: type[BaseModel],
                 response: type[BaseModel]) -> dict[str, Any]:
        return {"post": {
            "summary": summary, "operationId": op, "parameters": [tenant_header],
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": ref(request)}}},
            "responses": {
                "200": {"description": "The answer, or server-sent events when streaming",
                        "content": {"application/json": {"schema": ref(response)},
                                    "text/event-stream": {"schema": _SSE_EVENT}}},
                **errors(400, 401, 403, 404, 408, 413, 503)}}}

    paths: dict[str, Any] = {
        "/v1/completions": generate("Create a completion (OpenAI-compatible)",
                                    "createCompletion", CompletionRequest, CompletionResponse),
        "/v1/chat/completions": generate("Create a chat completion (OpenAI-compatible)",
                                         "createChatCompletion", ChatCompletionRequest,
                                         ChatCompletionResponse),
    }
    _apply_limits(components, replica)
    json_ok = {"application/json": {"schema": {"type": "object"}}}
    paths.update({
        "/v1/models": {"get": {"summary": "The served model", "operationId": "listModels",
                               "responses": {"200": {"description": "Models", "content": {
                                   "application/json": {"schema": ref(ModelList)}}}}}},
        "/v1/models/{model}": {"get": {
            "summary": "One model", "operationId": "retrieveModel",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The model", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ModelCard"}}}},
                **errors(404)}}},
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
                **errors(400, 401, 403, 408, 413)},
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
    })
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvfleet replica", "version": "1",
                 "description": f"Serves {replica.model_id} "
                                f"({replica.loaded.weights_digest})."},
        "paths": paths,
        "components": {"schemas": components},
    }


_SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` is a JSON chunk, or `[DONE]` last.",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["data"],
}


def _bound(props: dict[str, Any], name: str, maximum: int, *, items: bool = False) -> None:
    """Set the integer maximum of a field (of its items' integers with `items`)."""
    for branch in props[name].get("anyOf", [props[name]]):
        target = branch.get("items", {}) if items else branch
        if target.get("type") == "integer" and target.get("minimum", 0) >= 0:
            target["maximum"] = maximum


def _apply_limits(components: dict[str, Any], replica: Replica) -> None:
    """This replica's limits in the request schemas, so a schema-valid request fits them
    (except what JSON Schema cannot say: text is limited in tokens, not characters, and a
    prompt plus max_tokens must fit the context; both are 400s naming the numbers)."""
    limits, args = replica.config.limits, replica.loaded.args
    model = {"anyOf": [{"type": "string", "enum": [replica.model_id]}, {"type": "null"}],
             "default": None, "description": "The served model's id."}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        props["model"] = model
        for branch in props["logit_bias"]["anyOf"]:
            if branch.get("type") == "object":  # keys are token ids and nothing else
                branch["additionalProperties"] = False
        _bound(props, "stop_token_ids", args.vocab_size - 1, items=True)
        _bound(props, "min_tokens", limits.max_tokens)
        _bound(props, "truncate_prompt_tokens", limits.max_prompt_tokens)
        for field_name in ("max_tokens", "max_completion_tokens"):
            if field_name not in props:
                continue
            for branch in props[field_name].get("anyOf", [props[field_name]]):
                if branch.get("type") == "integer":
                    branch["maximum"] = limits.max_tokens
    # Characters bound tokens only for the byte tokenizer (one id per UTF-8 byte, plus BOS).
    max_chars = limits.max_prompt_tokens - 1
    byte_level = isinstance(replica.tokenizer, ByteTokenizer)
    for branch in components["CompletionRequest"]["properties"]["prompt"]["oneOf"]:
        items = branch.get("items", {})
        if branch["type"] == "string":
            if byte_level:
                branch["maxLength"] = max_chars
        elif items.get("type") == "string":
            if byte_level:
                items["maxLength"] = max_chars
        elif items.get("type") == "integer":
            branch["maxItems"] = limits.max_prompt_tokens
            items["maximum"] = args.vocab_size - 1
        else:
            items["maxItems"] = limits.max_prompt_tokens
            items["items"]["maximum"] = args.vocab_size - 1
