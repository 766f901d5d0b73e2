"""What a request brings, checked before a handler uses it: the tenant header, the JSON body (the
live size and time limits), the body against its model with one 400 naming every problem."""

from __future__ import annotations

import re
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvfleet_runtime.api import (
    PROMPT_TAGS,
    ApiError,
    read_json,
    refused_fields,
)
from kvfleet_runtime.server._auth import DEFAULTED_TENANT
from kvfleet_runtime.server._config import (
    Limits,
)
from kvfleet_runtime.server._schemas import (
    TENANT_PATTERN,
)
from kvfleet_runtime.wire import TENANT_HEADER

TENANT_RE = re.compile(TENANT_PATTERN)


def tenant_of(request: web.Request) -> str:
    tenant = request.get(DEFAULTED_TENANT) or request.headers.get(TENANT_HEADER)
    if not tenant:
        raise ApiError(400, f"missing header {TENANT_HEADER} (set by the router)",
                       param=TENANT_HEADER, code="missing_tenant")
    if not TENANT_RE.match(tenant):
        raise ApiError(400, f"header {TENANT_HEADER} {tenant[:80]!r} does not match "
                       f"{TENANT_PATTERN}", param=TENANT_HEADER, code="invalid_tenant")
    return tenant


async def json_body(request: web.Request, limits: Limits) -> Any:
    return await read_json(request, limits.max_body_bytes, limits.body_read_timeout_s)


M = TypeVar("M", bound=BaseModel)


def validate_body(model: type[M], data: Any, *, generation: bool = True) -> M:
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


