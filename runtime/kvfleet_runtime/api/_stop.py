"""Stop strings matched on streamed text: nothing after a stop string is ever sent.

Text arrives in pieces (one per token); a stop string may span pieces. `StopMatcher.push`
returns only text that can no longer be part of a stop string: everything up to the earliest
complete stop string (then `stopped` is set and the rest is dropped), or, while none is
complete, everything except the longest tail that is a prefix of some stop string. `flush`
releases the held tail when generation ends without a stop.

`include_stop=True` (vLLM's `include_stop_str_in_output`) returns the text up to and including
the stop string, and holds nothing back: the stop string is part of the answer anyway, so only a
tail of what was sent is kept, to find a stop string that spans pieces. `push(text,
check=False)` sends text that no stop string may end in (vLLM's `min_tokens`: stop strings are
looked for only in the text of later tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    def __init__(self, stops: Sequence[str], *, include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError(f"stop strings must be non-empty, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self.stopped = False
        self._held = ""
        self._sent_tail = ""
        """include_stop: the end of what was sent, as long as a stop string but one."""

    def push(self, text: str, *, check: bool = True) -> str:
        """The text now safe to send; after a stop, always ""."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        if not check:
            out, self._held = self._held + text, ""
            return out
        if self.include_stop:
            return self._push_including(text)
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def _push_including(self, text: str) -> str:
        buf = self._sent_tail + text
        ends = [i + len(s) for s in self.stops if (i := buf.find(s)) >= 0]
        if ends:
            self.stopped = True
            return buf[len(self._sent_tail):min(ends)]
        keep = max(len(s) for s in self.stops) - 1
        self._sent_tail = buf[len(buf) - keep:] if keep else ""
        return text

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
