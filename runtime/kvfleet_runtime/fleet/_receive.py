"""The T2 fetcher's HTTP/1.1 client: one POST, the response body received in place.

aiohttp's client copies a bulk body twice before the caller sees it (the socket read into a new
bytes object, the HTTP parser's chunk slice into another); here payload bytes go from the kernel
straight into the caller's destination views, one copy, as a raw socket does. The response head
arrives through an `asyncio.BufferedProtocol`; on a plain TCP connection the body is then read
from a duplicate of the socket with `recvmsg_into` (scatter reads: one call fills many
destination views, e.g. the rows of a KV chunk at their strided places in the canonical buffers),
the transport's own reading paused. Over TLS the transport keeps reading, into one view at a time
(`get_buffer`). HTTP chunk framing is parsed from a small staging buffer; payload bytes that land
there (a few per chunk boundary, or while no destination is set) are copied on.

Scope: exactly what the T2 route needs: one request per connection (`Connection: close`), a
status line and headers, then a chunked or Content-Length body read through `exactly(n)` and
`into_all(views)`. Errors: `OSError` (connect, reset), `asyncio.IncompleteReadError` (the peer
closed before the body ended), `ValueError` (malformed HTTP).
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

__all__ = ["BodyReader", "post"]

_STAGING = 64 << 10
_MAX_HEAD = 64 << 10
_MAX_PENDING = 8 << 20
"""Payload bytes buffered while no destination is set, before reading pauses."""
_MAX_VIEWS = 512
"""Destination views per scatter read (Linux allows 1024 iovecs)."""

_HEAD, _SIZE, _DATA, _DATA_CRLF, _TRAILER, _DONE = range(6)


class BodyReader(asyncio.BufferedProtocol):
    """Response head, then body bytes delivered into the views the caller asks for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.head: asyncio.Future[tuple[int, dict[str, str]]] = loop.create_future()
        self._staging = memoryview(bytearray(_STAGING))
        self._state = _HEAD
        self._buf = bytearray()  # head / chunk-size line / CRLF / trailer line being parsed
        self._chunked = False
        self._remaining = 0  # bytes left in the current HTTP chunk (or the Content-Length body)
        self._pending = bytearray()  # payload that arrived with no destination set
        self._targets: deque[memoryview] = deque()
        self._pos = 0  # filled bytes of _targets[0]
        self._waiter: asyncio.Future[None] | None = None
        self._direct = False
        self._paused = False
        self._closed: BaseException | None = None
        self._sock: socket.socket | None = None  # the body's reader, after the head (plain TCP)

    # -- protocol ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _DATA and self._targets and not self._pending:
            target = self._targets[0]
            n = min(len(target) - self._pos, self._remaining)
            if n > 0:
                self._direct = True
                return target[self._pos : self._pos + n]
        self._direct = False
        return self._staging

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._direct:
                self._remaining -= nbytes
                self._advance(nbytes)
                if not self._remaining:
                    self._end_of_data()
            else:
                self._feed(self._staging[:nbytes])
                if self._state not in (_HEAD, _DONE) and self._sock is None:
                    self._read_directly()
        except ValueError as exc:
            self._fail(exc)
            self.close(abort=True)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_direct()
        if self._closed is None:
            self._closed = exc if exc is not None else ConnectionResetError("peer closed")
        if not self.head.done():
            self.head.set_exception(ConnectionResetError(f"peer closed before answering: {exc}"))
        self._wake()

    def close(self, *, abort: bool = False) -> None:
        """Close the connection (the direct reader too)."""
        self._stop_direct()
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    # -- the body read from the socket itself (plain TCP) ------------------------------------

    def _read_directly(self) -> None:
        """Once the head is parsed: pause the transport's reading and read the body from a
        duplicate of its socket (scatter reads straight into the destination views)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_extra_info("sslcontext") is not None:
            return  # TLS: the transport decrypts, one view at a time
        raw = transport.get_extra_info("socket")
        if raw is None or raw.type != socket.SOCK_STREAM:
            return
        if not self._paused:
            transport.pause_reading()
        self._sock = raw.dup()
        self._sock.setblocking(False)
        if not self._paused:
            self.loop.add_reader(self._sock.fileno(), self._readable)

    def _stop_direct(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            self.loop.remove_reader(sock.fileno())
            sock.close()

    def _views(self) -> list[memoryview]:
        """Where the next body bytes go: destination views up to the end of the HTTP chunk."""
        if self._state != _DATA or not self._targets or self._pending:
            return []
        budget = self._remaining
        views: list[memoryview] = []
        pos = self._pos
        for target in self._targets:
            view = target[pos : pos + budget]
            pos = 0
            views.append(view)
            budget -= len(view)
            if not budget or len(views) == _MAX_VIEWS:
                break
        return views

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        views = self._views()
        try:
            if len(views) > 1:
                nbytes = sock.recvmsg_into(views)[0]
            else:
                nbytes = sock.recv_into(views[0] if views else self._staging)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._stop_direct()
            self._fail(exc)
            return
        if not nbytes:
            self._stop_direct()
            self._fail(ConnectionResetError("peer closed"))
            return
        self._direct = bool(views)
        self.buffer_updated(nbytes)

    def _pause(self) -> None:
        self._paused = True
        if self._sock is not None:
            self.loop.remove_reader(self._sock.fileno())
        elif self.transport is not None:
            self.transport.pause_reading()

    def _resume(self) -> None:
        self._paused = False
        if self._sock is not None:
            self.loop.add_reader(self._sock.fileno(), self._readable)
        elif self.transport is not None:
            self.transport.resume_reading()

    # -- the caller's side -------------------------------------------------------------------

    async def into_all(self, views: Sequence[memoryview]) -> None:
        """Fill `views`, in order, with the next body bytes."""
        self._targets = deque(v for v in views if len(v))
        self._pos = 0
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._deliver(memoryview(pending))
            if self._paused and len(self._pending) < _MAX_PENDING:
                self._resume()
        while self._targets:
            if self._closed is not None or self._state == _DONE:
                missing = sum(len(v) for v in self._targets) - self._pos
                self._targets.clear()
                raise asyncio.IncompleteReadError(b"", missing)
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def exactly(self, n: int) -> bytes:
        out = bytearray(n)
        await self.into_all([memoryview(out)])
        return bytes(out)

    async def into(self, out: memoryview) -> None:
        await self.into_all([out])

    # -- internals ---------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        if not self.head.done():
            self.head.set_exception(exc)
        self._wake()

    def _advance(self, n: int) -> None:
        self._pos += n
        while self._targets and self._pos >= len(self._targets[0]):
            self._pos -= len(self._targets.popleft())
        if not self._targets:
            self._pos = 0
            self._wake()

    def _deliver(self, data: memoryview) -> None:
        while data and self._targets:
            target = self._targets[0]
            take = min(len(data), len(target) - self._pos)
            target[self._pos : self._pos + take] = data[:take]
            data = data[take:]
            self._advance(take)
        if data:
            self._pending += data
            if len(self._pending) >= _MAX_PENDING and not self._paused:
                self._pause()

    def _end_of_data(self) -> None:
        if self._chunked:
            self._state = _DATA_CRLF
        else:
            self._state = _DONE
            self._wake()

    def _line(self, data: memoryview, limit: int) -> tuple[bytes | None, memoryview]:
        """Accumulate up to a CRLF: (the line without it, or None if incomplete; the rest)."""
        start = max(0, len(self._buf) - 1)
        self._buf += data
        end = self._buf.find(b"\r\n", start)
        if end < 0:
            if len(self._buf) > limit:
                raise ValueError("HTTP line too long")
            return None, data[len(data) :]
        line = bytes(self._buf[:end])
        rest = len(self._buf) - (end + 2)
        self._buf.clear()
        return line, data[len(data) - rest :]

    def _feed(self, data: memoryview) -> None:
        while data:
            state = self._state
            if state == _HEAD:
                start = max(0, len(self._buf) - 3)
                self._buf += data
                end = self._buf.find(b"\r\n\r\n", start)
                if end < 0:
                    if len(self._buf) > _MAX_HEAD:
                        raise ValueError("HTTP response head too long")
                    return
                rest = len(self._buf) - (end + 4)
                head = bytes(self._buf[:end])
                self._buf.clear()
                data = data[len(data) - rest :]
                self._parse_head(head)
            elif state == _SIZE:
                line, data = self._line(data, 1024)
                if line is None:
                    return
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size < 0:
                    raise ValueError("negative HTTP chunk size")
                if size:
                    self._state, self._remaining = _DATA, size
                else:
                    self._state = _TRAILER
            elif state == _DATA:
                take = data[: self._remaining]
                data = data[len(take) :]
                self._remaining -= len(take)
                self._deliver(take)
                if not self._remaining:
                    self._end_of_data()
            elif state == _DATA_CRLF:
                line, data = self._line(data, 2)
                if line is None:
                    return
                if line:
                    raise ValueError("HTTP chunk not followed by CRLF")
                self._state = _SIZE
            elif state == _TRAILER:
                line, data = self._line(data, 8192)
                if line is None:
                    return
                if not line:
                    self._state = _DONE
                    self._wake()
            else:  # _DONE: nothing more is expected on a `Connection: close` request
                return

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"bad HTTP status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"bad HTTP header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked, self._state = True, _SIZE
        else:
            length = int(headers.get("content-length", "0"))
            if length < 0:
                raise ValueError("negative Content-Length")
            self._remaining = length
            self._state = _DATA if length else _DONE
        if not self.head.done():
            self.head.set_result((status, headers))


async def post(
    url: str, path: str, body: Any, headers: dict[str, str], *, connect_timeout_s: float
) -> tuple[int, BodyReader]:
    """POST `body` (JSON) to `url` + `path`; returns (status, reader of the body). The caller
    closes the reader (`reader.close()`) when done."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"unsupported peer URL {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    context = ssl.create_default_context() if parts.scheme == "https" else None
    _, reader = await asyncio.wait_for(
        loop.create_connection(lambda: BodyReader(loop), parts.hostname, port, ssl=context),
        connect_timeout_s,
    )
    try:
        payload = json.dumps(body).encode()
        host = parts.netloc.rsplit("@", 1)[-1]
        lines = [
            f"POST {parts.path.rstrip('/')}{path} HTTP/1.1",
            f"Host: {host}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        assert reader.transport is not None
        reader.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        status, _ = await reader.head
    except BaseException:
        reader.close(abort=True)
        raise
    return status, reader
