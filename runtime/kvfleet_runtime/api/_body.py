"""Reading a JSON request body so that no body can cost a 5xx, a stuck connection or a traceback.

- size: `Content-Length` over the limit is refused before reading; a chunked body is counted as
  it arrives and refused at the first byte over (413);
- time: the whole body must arrive within `timeout_s` (a client announcing 100 bytes and sending
  10 would otherwise hold the connection open): 408;
- framing: a bad chunk size or a connection cut mid-body is 400 `invalid_body_encoding`, never
  the 500 and traceback that aiohttp's own `RequestPayloadError` would give;
- encoding: the body is decoded here, not by aiohttp (`handler_args` turns its decoder off: it
  never checked a gzip stream's trailer, passed an unknown coding such as `snappy` on as
  identity, and answered `br`/`zstd` with "Please install Brotli"). `Content-Encoding` may list
  `identity`, `gzip` (`x-gzip`) and `deflate` (zlib or raw, as clients send it); anything else
  is 415 `unsupported_content_encoding`, naming the ones accepted. A stream that does not decode,
  ends before its trailer (gzip: CRC-32 and size; zlib: Adler-32) or has bytes after it is 400
  `invalid_body_encoding`; the decoded size counts against the limit as it is inflated (a bomb
  is refused at the first byte over, 413);
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
import zlib
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
    """The body, decoded (`Content-Encoding`), at most `limit_bytes` before and after decoding,
    all of it within `timeout_s`."""
    length = request.content_length
    if length is not None and length > limit_bytes:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of "
                       f"{limit_bytes} bytes", code="body_too_large")
    encoding = request.headers.get("Content-Encoding")
    decoders = _decoders(encoding, limit_bytes)  # refused (415) before the body is read
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
            raise _undecodable(encoding, _reason(exc)) from None
        if not chunk:
            chunks.append(_decode(decoders, b"", end=True))
            break
        size += len(chunk)
        if size > limit_bytes:
            raise ApiError(413, f"request body exceeds the limit of {limit_bytes} bytes",
                           code="body_too_large")
        chunks.append(_decode(decoders, chunk, end=False))
    return b"".join(chunks)


def _decode(decoders: list[_Inflater], data: bytes, *, end: bool) -> bytes:
    """`data` (coded body bytes; `end`: the body ended) through every decoder, outermost first."""
    for decoder in decoders:
        out = decoder.feed(data) if data else b""
        data = out + decoder.finish() if end else out
    return data


_MAX_CODINGS = 4
"""Codings one body may stack (`gzip, gzip`): each is bounded by the limit, this bounds the
work."""
_ACCEPTED_CODINGS = "identity, gzip (x-gzip) or deflate"


def _decoders(header: str | None, limit_bytes: int) -> list[_Inflater]:
    """The decoders for a `Content-Encoding` value, outermost (last applied) first; 415 for a
    coding not decoded here."""
    if not header:
        return []
    codings = [c.strip().lower() for c in header.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    unknown = next((c for c in codings if c not in _WBITS), None)
    if unknown is not None or len(codings) > _MAX_CODINGS:
        what = f"Content-Encoding {one_line(header, 60)}"
        raise ApiError(415, f"{what} is not supported: send the body as {_ACCEPTED_CODINGS}"
                       + (f" (at most {_MAX_CODINGS} codings)" if unknown is None else ""),
                       code="unsupported_content_encoding",
                       headers={"Accept-Encoding": "identity, gzip, deflate",
                                "Connection": "close"})
    return [_Inflater(c, header, limit_bytes) for c in reversed(codings)]


_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _undecodable(encoding: str | None, why: str) -> ApiError:
    return ApiError(400, "request body could not be read"
                    + (f" (Content-Encoding {one_line(encoding, 40)})" if encoding else "")
                    + f": {one_line(why)}", code="invalid_body_encoding",
                    headers={"Connection": "close"})


class _Inflater:
    """One coding's streaming decoder, its output bounded (`limit_bytes`) as it inflates.
    `deflate` is zlib (RFC 1950) or, when the first two bytes are no zlib header, raw deflate
    (what some clients send; aiohttp guessed the same way)."""

    def __init__(self, coding: str, header: str, limit_bytes: int) -> None:
        self.coding = coding
        self.header = header
        self.limit_bytes = limit_bytes
        self.num_out = 0
        self._z: Any = None
        self._head = b""

    def _start(self, data: bytes) -> bytes:
        if self._z is not None:
            return data
        if self.coding == "deflate":
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return b""
            zlib_header = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._z = zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)
        else:
            self._z = zlib.decompressobj(_WBITS[self.coding])
        return data

    def _bounded(self, out: bytes) -> bytes:
        self.num_out += len(out)
        if self.num_out > self.limit_bytes:
            raise ApiError(413, f"request body exceeds the limit of {self.limit_bytes} bytes "
                           f"once decoded (Content-Encoding {one_line(self.header, 40)})",
                           code="body_too_large")
        return out

    def feed(self, data: bytes) -> bytes:
        """The decoded bytes of `data` (more of the coded body)."""
        data = self._start(data)
        if not data:
            return b""
        if self._z.eof:
            raise _undecodable(self.header, f"bytes after the end of the {self.coding} stream")
        try:
            out = self._z.decompress(data, self.limit_bytes - self.num_out + 1)
        except zlib.error as exc:
            raise _undecodable(self.header, f"not a valid {self.coding} stream ({exc})") from None
        out = self._bounded(out)
        if self._z.unused_data:
            raise _undecodable(self.header, f"bytes after the end of the {self.coding} stream")
        return out

    def finish(self) -> bytes:
        """The body ended: what is still buffered; 400 when the stream is not complete (a gzip
        stream without its CRC-32 and size, a zlib stream without its Adler-32)."""
        if self._z is None:
            if self._head:
                raise _undecodable(self.header, f"a {self.coding} stream of one byte")
            return b""  # an empty body: nothing was coded
        try:
            out = self._bounded(self._z.flush())
        except zlib.error as exc:
            raise _undecodable(self.header, f"not a valid {self.coding} stream ({exc})") from None
        if not self._z.eof:
            trailer = "CRC-32 and size" if self.coding != "deflate" else "checksum"
            raise _undecodable(self.header, f"the {self.coding} stream is cut before its end "
                               f"(its {trailer})")
        return out


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
