"""Server-sent events as the router relays them: whole events only (pure, no I/O).

A replica's stream arrives in whatever pieces TCP cuts it into; an event is complete at its
blank line (two line ends in a row: CRLF, LF or CR, as the SSE spec reads them). The relay
forwards only complete events, so a stream cut mid-event (`data: {"id":"c","obj`) never reaches
the client half-written: the partial bytes are dropped and the router's error event goes out on
its own (the official `openai` client then raises `APIError`, not `JSONDecodeError` on the glued
bytes).

    events = SseEvents()
    for piece in stream:
        for event in events.feed(piece):   # whole events, bytes as the replica sent them
            send(event)
    if events.partial.strip():             # the stream ended inside an event: it was cut
        send(error_event(...))
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_EVENT_BYTES", "EventTooLarge", "SseEvents", "data_lines", "error_event"]

MAX_EVENT_BYTES = 1 << 20
"""The longest event held while it arrives: a token event is ~200 bytes, a final one with
usage and logprobs a few KB; a replica sending a megabyte without a blank line is broken."""

_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
"""A blank line: a line end right after a line end (`\\r` alone is a line end only when no `\\n`
follows: `\\r\\n` is one)."""
_LINE_END = re.compile(rb"\r\n|\r|\n")


class EventTooLarge(ValueError):
    """More than `MAX_EVENT_BYTES` arrived without completing an event."""


class SseEvents:
    """Splits a byte stream into whole SSE events, each with its terminating blank line."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes must be >= 1, got {max_event_bytes}")
        self.max_event_bytes = max_event_bytes
        self._buffer = b""
        self._scanned = 0
        """Bytes of the buffer already searched for an event end (minus the 2 a line end that
        spans two pieces may start with)."""

    @property
    def partial(self) -> bytes:
        """The bytes of an event not yet complete (what a cut would drop)."""
        return self._buffer

    def feed(self, piece: bytes) -> list[bytes]:
        """The events `piece` completes, in order; raises `EventTooLarge` when the incomplete
        one passes the bound."""
        buffer = self._buffer + piece
        events: list[bytes] = []
        start = 0
        # A trailing CR may be the first half of a CRLF: decided once the next byte is here.
        end = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
        pos = max(0, self._scanned - 2)
        while True:
            match = _EVENT_END.search(buffer, pos, end)
            if match is None:
                break
            events.append(buffer[start:match.end()])
            start = pos = match.end()
        self._buffer = buffer[start:]
        self._scanned = max(0, end - start)
        if len(self._buffer) > self.max_event_bytes:
            raise EventTooLarge(f"more than {self.max_event_bytes} bytes without an event's end")
        return events


def data_lines(event: bytes) -> list[bytes]:
    """The values of an event's `data` fields (the leading space after the colon dropped, as
    the spec says)."""
    out = []
    for line in _LINE_END.split(event):
        if line == b"data" or line.startswith(b"data:"):
            value = line[5:]
            out.append(value[1:] if value.startswith(b" ") else value)
    return out


def error_event(body: dict[str, Any]) -> bytes:
    """One whole event carrying OpenAI's error envelope (`api.error_body`)."""
    return f"data: {json.dumps(body)}\n\n".encode()
