"""The HTTP listener of every kvfleet server (router, replica, peer port): limits on what a
connection may send before a handler runs, and aiohttp's own refusals in the error envelope.

aiohttp parses the request line and headers itself; what it refuses (a header over 8 KiB, too
many headers, a 100k-character URL, a bad or negative `Content-Length`, `Content-Length` with
`Transfer-Encoding`, a bad chunk size, an unknown method, TLS bytes on the HTTP port, a
`Content-Encoding` it cannot decode) never reaches the app's middlewares. By default it answers
those in plain text and logs each with an ERROR traceback, so any client could fill the logs.
Here:

- `EnvelopeRequestHandler.handle_error` answers them in OpenAI's envelope (400, 414 or 431,
  `code` `malformed_request`, the parser's reason cut to one short line) and logs one bounded
  INFO line; TLS or garbage as a connection's first bytes logs at DEBUG (a scanner's noise).
  A 500 (a bug in a handler that escaped the middleware) keeps its traceback.
- `ListenerLimits` sets the parser's limits explicitly (nginx's and Envoy's values) and the
  deadline for a request head (`header_timeout_s`, nginx's `client_header_timeout`): aiohttp's
  keep-alive timer runs from a connection's start and from the end of each answer, and closes a
  connection whose next head is not complete by then (slow headers, idle keep-alive alike).
- The handler's logger (`BoundedServerLog`) turns the exception records aiohttp writes for input
  errors found after a handler returned (the rest of a body that does not decode) into one line.
- `Expect`: aiohttp answers `100-continue` itself and anything else with a plain-text 417 from
  outside the app's middlewares; here an expectation other than `100-continue` is a 417
  `expectation_failed` in the envelope (`_refuse_expectation`), before any route runs.
- Bodies are decoded by `api.read_body`, not by aiohttp's parser (`auto_decompress` off): the
  parser never checked a gzip trailer and passed unknown codings on as identity.

`handler_args(limits)` goes to `web.Application(handler_args=...)` (every runner then applies the
limits); `AppRunner` (and `run_app`) add the envelope for parser errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvfleet_runtime.api._errors import CANCEL_ON_DISCONNECT, error_response, one_line

__all__ = [
    "AppRunner",
    "BoundedServerLog",
    "EnvelopeRequestHandler",
    "ListenerLimits",
    "handler_args",
    "run_app",
]

log = logging.getLogger("kvfleet.http")


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """What one connection may send before a handler runs (docs/security.md, "Deadlines")."""

    header_timeout_s: float = 60.0
    """A request head must be complete within this of the connection's start or of the end of
    the previous answer; also how long an idle keep-alive connection stays open. nginx's
    `client_header_timeout` (60 s); above the router's upstream pool keep-alive (30 s), so the
    router never reuses a connection a replica is about to close."""
    max_line_bytes: int = 8190
    """Request line (method, URL, version): nginx's `large_client_header_buffers` 8k."""
    max_field_bytes: int = 8190
    """One header field, name and value: the same 8k."""
    max_headers: int = 100
    """Header fields per request: Envoy's `max_headers_count` default."""
    lingering_s: float = 5.0
    """After an answer sent before the whole body arrived, how long the rest is read and dropped
    (so the client sees the answer rather than a reset): nginx's `lingering_time` is 30 s, but a
    body here is bounded by its own read deadline."""

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "lingering_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_line_bytes", "max_field_bytes", "max_headers"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")


def _input_error(exc: BaseException | None) -> bool:
    """An error caused by what the client sent (not by a bug here)."""
    while exc is not None:
        if isinstance(exc, HttpProcessingError | web.RequestPayloadError | ConnectionError):
            return True
        exc = exc.__cause__
    return False


def _reason(exc: BaseException | None, fallback: str | None) -> str:
    """The parser's reason and the offending bytes, one line (aiohttp writes the bytes on a line
    of their own under the reason, and a caret under them)."""
    text = getattr(exc, "message", None) or (str(exc) if exc is not None else "") or fallback
    lines = [line.strip() for line in str(text or "bad request").splitlines() if line.strip()]
    lines = [line for line in lines if set(line) != {"^"}]
    head = lines[0].rstrip(":") if lines else "bad request"
    return one_line(f"{head}: {lines[1]}" if len(lines) > 1 else head)


class BoundedServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger: an exception caused by client input is one INFO line, never a
    traceback; any other exception (a bug) keeps its traceback at ERROR."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kw: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if _input_error(exc):
            self.logger.info("%s: %s", one_line(str(msg) % args if args else msg),
                             _reason(exc, None))
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kw)


class EnvelopeRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering its parser's refusals in the error envelope."""

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500 and not _input_error(exc):
            return super().handle_error(request, status, exc, message)
        status = min(status, 499)
        if isinstance(exc, LineTooLong):
            # nginx's answers: 414 for the URL, 431 for a header
            line = exc.args[0] if exc.args else b""
            is_url = isinstance(line, bytes | bytearray | str) and line[:1] in (b"/", "/")
            status = 414 if is_url else 431
        reason = _reason(exc, message)
        first = self._request_count == 1 and isinstance(exc, BadHttpMethod)
        log.log(logging.DEBUG if first else logging.INFO,
                "refused a malformed request from %s: %s", request.remote, reason)
        if request.writer.output_size > 0:
            # part of an answer is out already: nothing more can be said on this connection
            raise ConnectionError("answer already started; cannot send the error")
        resp = error_response(status, f"malformed HTTP request: {reason}",
                              code="malformed_request")
        resp.force_close()
        return resp


def _refuse_expectation(request: BaseRequest) -> web.StreamResponse | None:
    """The 417 for an `Expect` other than `100-continue` (RFC 9110: a server may refuse any
    expectation it does not know; aiohttp does, in plain text); None to serve the request."""
    expect = request.headers.get(hdrs.EXPECT)
    if not expect or request.version < HttpVersion11 or expect.strip().lower() == "100-continue":
        return None
    log.info("refused an expectation from %s: Expect: %s", request.remote, one_line(expect, 80))
    resp = error_response(417, f"Expect: {one_line(expect, 80)} is not supported (only "
                          "100-continue is)", code="expectation_failed")
    resp.force_close()  # the body the client may be sending is not wanted
    return resp


class _EnvelopeServer(web.Server):
    _app_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]]

    def __call__(self) -> RequestHandler:
        return EnvelopeRequestHandler(self, loop=self._loop, **self._kwargs)

    async def _handle_with_expectations(self, request: BaseRequest) -> web.StreamResponse:
        refusal = _refuse_expectation(request)
        if refusal is not None:
            return refusal
        return await self._app_handler(request)


class AppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer parser errors in the envelope; cancels a
    handler whose client went away (`CANCEL_ON_DISCONNECT`) unless told otherwise."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("handler_cancellation", CANCEL_ON_DISCONNECT)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds the Server (app startup, handler args, access log) in one private
        # step; only the connection handler's class differs, and Server has no slots.
        server.__class__ = _EnvelopeServer
        assert isinstance(server, _EnvelopeServer)
        # Expectations are checked before the app: aiohttp's own check runs before the
        # middlewares (its 417 could not be put in the envelope there).
        server._app_handler = server.request_handler
        server.request_handler = server._handle_with_expectations
        return server


def handler_args(limits: ListenerLimits, logger: logging.Logger | None = None) -> dict[str, Any]:
    """`web.Application(handler_args=...)`: the parser's limits, the head deadline and the
    bounded server log for every connection of that app."""
    return {
        "max_line_size": limits.max_line_bytes,
        "max_field_size": limits.max_field_bytes,
        "max_headers": limits.max_headers,
        "keepalive_timeout": limits.header_timeout_s,
        "lingering_time": limits.lingering_s,
        "auto_decompress": False,  # `api.read_body` decodes (and checks) bodies itself
        "logger": BoundedServerLog(logger or logging.getLogger("aiohttp.server"), {}),
    }


def run_app(app: web.Application, host: str, port: int) -> None:
    """Serve `app` until SIGINT or SIGTERM (what `web.run_app` does, with `AppRunner`)."""

    async def serve() -> None:
        runner = AppRunner(app, handle_signals=True)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(web.GracefulExit, KeyboardInterrupt):
        asyncio.run(serve())
