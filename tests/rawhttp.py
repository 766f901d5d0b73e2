"""Raw HTTP/1.1 over a loopback socket: for requests no HTTP client will send (bad framing, bad
encodings, slow or broken heads), and for reading exactly what the server answered."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> dict[str, Any]:
        """The OpenAI error envelope's `error` object (AssertionError when not the envelope)."""
        assert self.headers.get("content-type", "").startswith("application/json"), self
        data = self.json()
        assert set(data) == {"error"}, data
        err = data["error"]
        assert {"message", "type", "param", "code"} <= set(err), err
        assert isinstance(err["message"], str) and err["message"], err
        return err  # type: ignore[no-any-return]


def exchange(port: int, data: bytes | list[bytes], *, timeout_s: float = 10.0,
             pause_s: float = 0.0) -> RawAnswer | None:
    """Send `data` (pieces `pause_s` apart) and read one answer; None when the server closed the
    connection without answering."""
    pieces = [data] if isinstance(data, bytes) else data
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        for i, piece in enumerate(pieces):
            if i and pause_s:
                time.sleep(pause_s)
            try:
                conn.sendall(piece)
            except OSError:
                break  # the server refused early and closed: read what it answered
        return read_answer(conn)


def read_answer(conn: socket.socket) -> RawAnswer | None:
    raw = b""
    while b"\r\n\r\n" not in raw:
        try:
            chunk = conn.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return None if not raw else _parse(raw)
        raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    headers = _headers(head)
    length = headers.get("content-length")
    if length is not None:
        while len(rest) < int(length):
            chunk = conn.recv(65536)
            if not chunk:
                break
            rest += chunk
    return _parse(head + b"\r\n\r\n" + rest)


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        out[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    return out


def _parse(raw: bytes) -> RawAnswer:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return RawAnswer(status, _headers(head), body)


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            *, content_length: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if content_length and body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
