"""Reading a JSON request body so that no body can cost a 5xx, a stuck connection or a traceback.

- size: `Content-Length` over the limit is refused before reading; a chunked body is counted as
  it arrives and refused at the first byte over (413);
- time: the whole body must arrive within `timeout_s` (a client announcing 100 bytes and sending
  10 would otherwise hold the connection open): 408;
- framing and encoding: a body aiohttp cannot decode (a `Content-Encoding: gzip` or `deflate`
  body that is not, a bad chunk size, a connection cut mid-body) is 400 `invalid_body_encoding`,
  never the 500 and traceback that aiohttp's own `RequestPayloadError` would give;
- integers: at most `MAX_INT_DIGITS` digits (Python refuses to parse more than 4,300 with a
  ValueError, and a 4,000-digit one is never a meaningful request field); floats must be finite
  (`1e999`, `NaN`, `Infinity` are refused);
- nesting: at most `MAX_DEPTH` levels (deeper JSON makes the parser recurse until it fails);
- strings: no lone surrogates (`"\\ud800"` parses in Python but cannot be encoded as UTF-8, so
  it would fail tokenization or forwarding later).
Every refusal is an `ApiError` (400, 408 or 413) whose message names the problem.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvfleet_runtime.api._errors import ApiError, one_line

__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "parse_json", "read_body", "read_json"]

MAX_INT_DIGITS = 20
"""Enough for any 64-bit value (2**64 has 20 digits)."""
MAX_DEPTH = 32
"""The deepest request (chat content parts) nests 5 levels."""
_CHUNK_BYTES = 1 << 16


async def read_body(request: web.Request, limit_bytes: int, timeout_s: float) -> bytes:
    """The raw body, at most `limit_bytes`, all of it within `timeout_s`."""
    length = request.content_length
    if length is not None and length > limit_bytes:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of "
                       f"{limit_bytes} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout_s
    while True:
        left_s = deadline - time.monotonic()
        try:
            if left_s <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(request.content.read(_CHUNK_BYTES), left_s)
        except TimeoutError:
            raise ApiError(408, f"request body did not arrive within {timeout_s:g} s "
                           f"({size} bytes received"
                           + (f" of {length} announced)" if length is not None else ")"),
                           code="body_timeout", headers={"Connection": "close"}) from None
        except (web.RequestPayloadError, HttpProcessingError) as exc:
            encoding = request.headers.get("Content-Encoding")
            raise ApiError(400, "request body could not be read"
                           + (f" (Content-Encoding {one_line(encoding, 40)})" if encoding else "")
                           + f": {one_line(_reason(exc))}", code="invalid_body_encoding",
                           headers={"Connection": "close"}) from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit_bytes:
            raise ApiError(413, f"request body exceeds the limit of {limit_bytes} bytes",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(exc: BaseException) -> str:
    """aiohttp's message without its `400, message:` prefix."""
    cause = exc.__cause__ if isinstance(exc, web.RequestPayloadError) and exc.__cause__ else exc
    return getattr(cause, "message", None) or str(cause) or type(cause).__name__


async def read_json(request: web.Request, limit_bytes: int, timeout_s: float) -> Any:
    return parse_json(await read_body(request, limit_bytes, timeout_s))


def parse_json(raw: bytes) -> Any:
    """Parse a request body; bad JSON, huge numbers, deep nesting, lone surrogates -> 400."""
    try:
        data = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_refuse_constant)
    except _Refused as exc:
        raise ApiError(400, f"request body is not acceptable JSON: {exc}",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_DEPTH} levels",
                       code="invalid_json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError as exc:  # anything else the parser refuses
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    _check_tree(data)
    return data


class _Refused(ValueError):
    pass


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"the number {text[:40]} is out of range")
    return value


def _refuse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _check_tree(data: Any) -> None:
    """Depth and lone surrogates, iteratively (no recursion to exhaust)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise ApiError(400, f"request body nests deeper than {MAX_DEPTH} levels",
                           param=where.split(".", maxsplit=1)[0] or None, code="invalid_json")
        if isinstance(value, dict):
            for k, v in value.items():
                path = f"{where}.{k}" if where else str(k)
                _check_text(k, path)
                stack.append((v, depth + 1, path))
        else:
            stack.extend((v, depth + 1, f"{where}.{i}" if where else str(i))
                         for i, v in enumerate(value))


def _check_text(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{where or 'body'}: a lone surrogate "
                       f"U+{ord(text[exc.start]):04X} at character {exc.start} is not valid "
                       f"Unicode text", param=where.split(".", maxsplit=1)[0] or None,
                       code="invalid_unicode") from None
