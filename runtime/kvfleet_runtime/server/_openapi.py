"""The replica's OpenAPI 3.1 document: schemas from the protocol models (`kvfleet_runtime.api`),
limits from the live config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvfleet_runtime.api import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from kvfleet_runtime.server._schemas import (
    TENANT_PATTERN,
    InvalidateAccepted,
    InvalidateRequest,
)
from kvfleet_runtime.server._state import Replica
from kvfleet_runtime.tokenizer import ByteTokenizer
from kvfleet_runtime.wire import TENANT_HEADER


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
