"""The one OpenAI-shaped error envelope, and the middleware that makes every error use it.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Replica, router and peer transfer answer every error with it, including the framework's own
404 (no route), 405 (wrong method), 413 (body over aiohttp's cap) and 500 (a bug), so the
`openai` client shows the message and not just "Error code: 404".

Raise `ApiError(status, message, param=, code=)` from a handler; `error_middleware` turns it
(and `web.HTTPException`, and anything unexpected) into the envelope. A client that went away
is not an error: the middleware logs it at DEBUG and answers nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = [
    "CANCEL_ON_DISCONNECT",
    "ApiError",
    "error_body",
    "error_middleware",
    "error_response",
    "is_client_gone",
    "one_line",
]

CANCEL_ON_DISCONNECT = True
"""aiohttp's `handler_cancellation` for every server that runs these apps: a client that goes
away cancels its handler, so the replica cancels the sequences (streamed or not) and the router
its upstream request, instead of computing an answer nobody reads."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An HTTP error answer: status, a message naming the problem and the value, OpenAI fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None
                   ) -> web.Response:
    return web.json_response(error_body(status, message, param=param, code=code),
                             status=status, headers=headers)


MAX_MESSAGE_CHARS = 200
"""Longest piece of client-sent text quoted in an error message or a log line: a refusal costs
the server one short line whatever the client sent (a 2 GB value is quoted as 200 characters)."""


def one_line(text: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` as one printable line of at most `limit` characters (quoted client input, a
    parser's message): control characters and newlines escaped, the rest cut with `...`."""
    raw = text if isinstance(text, str) else str(text)
    if len(raw) > 4 * limit:
        raw = raw[: 4 * limit]  # the escaping below is linear: never run it over a huge input
    flat = raw.encode("unicode_escape", errors="backslashreplace").decode("ascii")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def is_client_gone(exc: BaseException) -> bool:
    """A write to, or read from, a client that closed its connection."""
    return isinstance(exc, ConnectionResetError | BrokenPipeError)


_FRAMEWORK_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_middleware(log: logging.Logger) -> Middleware:
    """aiohttp middleware: every error as the envelope; unexpected exceptions logged to `log`."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                                  headers=exc.headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            default = f"{exc.status}: {exc.reason}"
            message = exc.text if exc.text and exc.text != default else (
                f"{exc.reason}: {request.method} {request.path}")
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return error_response(exc.status, message, code=_FRAMEWORK_CODES.get(exc.status),
                                  headers=headers)
        except Exception as exc:
            if is_client_gone(exc):
                # Nothing can reach the client any more; aiohttp closes the connection quietly.
                log.debug("client went away during %s %s", request.method, request.path)
                return web.Response(status=499)
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, "internal error", code="internal_error")

    return middleware
