"""The router's OpenAPI document: the replicas' OpenAI operations (their schemas and limits)
with the router's API-key auth instead of the tenant header, and the router's own probes (pure)."""

from __future__ import annotations

import json
from typing import Any

from kvfleet_runtime.wire import TENANT_HEADER

__all__ = ["PROXIED_PATHS", "router_openapi"]

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}")


def router_openapi(replica_doc: dict[str, Any]) -> dict[str, Any]:
    """The router's OpenAPI: the replicas' OpenAI operations (their schemas and limits), with
    the router's API-key auth instead of the tenant header, and the router's own probes."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    json_ok = {"application/json": {"schema": {"type": "object"}}}
    paths: dict[str, Any] = {}
    for path in PROXIED_PATHS:
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
