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
    """The final answer on `conn`; interim 1xx answers (`100 Continue`) are skipped."""
    raw = b""
    while True:
        while b"\r\n\r\n" not in raw:
            try:
                chunk = conn.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None if not raw else _parse(raw)
            raw += chunk
        if not raw.startswith(b"HTTP/1.1 1"):
            break
        raw = raw.partition(b"\r\n\r\n")[2]
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


TLS_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(range(32)) + b"\x00" * 64
"""The start of a TLS ClientHello, as a client that speaks HTTPS to an HTTP port sends it."""


def malformed(path: str) -> dict[str, bytes]:
    """Requests aiohttp's HTTP parser itself refuses (issue 25 item 8), by name."""
    post = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return {
        "header_over_8k": request("GET", "/healthz", headers={"X-Big": "a" * 9000}),
        "ten_thousand_headers": ("GET /healthz HTTP/1.1\r\nHost: x\r\n"
                                 + "".join(f"X-H{i}: v\r\n" for i in range(10_000))
                                 + "\r\n").encode(),
        "url_of_100k": f"GET /{'u' * 100_000} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        "negative_content_length": (post + "Content-Length: -5\r\n\r\n{}").encode(),
        "huge_content_length": (post + "Content-Length: 99999999999999999999999\r\n\r\n").encode(),
        "length_and_chunked": (post + "Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
                               "2\r\n{}\r\n0\r\n\r\n").encode(),
        "bad_chunk_size": (post + "Transfer-Encoding: chunked\r\n\r\n"
                           "zz\r\n{}\r\n0\r\n\r\n").encode(),
        "unknown_method": b"FR\x00B /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        "bad_version": b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
        "space_in_header_name": b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n",
        "nul_in_header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
        "tls_on_http_port": TLS_HELLO,
        "garbage": b"\xff\xfe\xfd hello\r\n\r\n",
    }


def cut_while_sending(port: int, pieces: list[bytes], pause_s: float) -> bool:
    """Send `pieces` `pause_s` apart (a slow client); True when the server closed the connection
    before the last piece went out, without answering anything."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.settimeout(pause_s)
        for piece in pieces:
            try:
                conn.sendall(piece)
                return not conn.recv(65536)  # b"": closed; bytes: it answered instead
            except TimeoutError:
                continue  # still open, nothing said: send the next piece
            except OSError:
                return True
    return False
