"""Stop strings matched on streamed text: nothing after a stop string is ever sent.

Text arrives in pieces (one per token); a stop string may span pieces. `StopMatcher.push`
returns only text that can no longer be part of a stop string: everything up to the earliest
complete stop string (then `stopped` is set and the rest is dropped), or, while none is
complete, everything except the longest tail that is a prefix of some stop string. `flush`
releases the held tail when generation ends without a stop.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        """The text now safe to send; after a stop, always ""."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
