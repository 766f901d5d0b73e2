"""The one config-file watcher of the replica, the router and the fleet tier.

A process calls `ConfigFileWatcher.poll()` once per poll interval (on a worker thread: a poll
that sees new content sleeps a few milliseconds). A change applies at the first poll that sees
it, and only whole files are applied:

    content = watcher.poll()         # new settled content, or None
    if content is not None:
        try:
            config = parse(content)  # the bytes the watcher read, never the file again
        except ValueError:
            watcher.reject(content)  # the last good config stays in force
        else:
            apply(config)
            watcher.accept(content)

Why a half-written file is never applied (decided for issue 18, where a toggle used to wait one
more poll for the file to hold still):

- The settle re-read. On new content the watcher waits `settle_s` and reads the file again, in
  the same poll; other bytes mean a writer is at work, so nothing applies this poll and the next
  poll looks again. An editor or `kubectl cp` truncates and then writes within milliseconds; a
  ConfigMap volume swaps a symlink, which is atomic (the re-read only confirms it).
- An empty (or whitespace-only) file is never handed out. That is what a file looks like between
  its truncation and its write, and it parses as valid YAML with every default (all tiers back to
  their defaults): it keeps the config in force, like a missing or unreadable file.
- A file that does not parse is rejected by the caller and keeps the last good config. It is
  handed out again at every poll until it changes (`repeated` then says the caller already
  reported it), so a writer that stalled past the settle delay is picked up once it finishes.
- The fleet config's readers also refuse a config without a `generation` after one that had one
  (`fleetconfig.check_successor`): the operator always writes it, so its absence means a
  hand-written file cut short where it still parses. Generations are not required to grow: a
  recreated policy starts again from 1.

A missing file keeps the config in force (a ConfigMap update never removes the file: a missing
one is a mistake or a rename in progress); when it returns, it applies if its content differs
from what is in force. `num_polls` and `applied_at_poll` count polls, so that "applied within one
poll" can be checked without clocks (the fleet tier reports both in its load report).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_SETTLE_S", "ConfigFileWatcher", "read_fingerprint"]

DEFAULT_SETTLE_S = 0.02
"""The settle delay: long against a truncate-then-write (microseconds to a few ms), short
against a poll interval (seconds)."""


def read_fingerprint(path: Path) -> bytes | None:
    """The file's bytes, or None when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError:
        return None


@dataclass(slots=True)
class ConfigFileWatcher:
    """Apply-at-first-sight change detection for one file. Construct it BEFORE the first load:
    the content it starts from is what the process is assumed to have applied, so a write between
    the two is seen as a change and loaded again (harmless), never missed."""

    path: Path
    settle_s: float = DEFAULT_SETTLE_S
    num_polls: int = field(init=False, default=0)
    """Polls so far."""
    applied_at_poll: int = field(init=False, default=0)
    """The poll whose content was last accepted (0: the content the watcher started from)."""
    num_unsettled: int = field(init=False, default=0)
    """Polls that saw the file change between their two reads (a write in progress)."""
    repeated: bool = field(init=False, default=False)
    """The content `poll` just returned was rejected before: the caller has reported it."""
    _applied: bytes | None = field(init=False)
    _rejected: bytes | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.settle_s >= 0:
            raise ValueError(f"settle_s must be >= 0, got {self.settle_s!r}")
        self._applied = read_fingerprint(self.path)

    def poll(self) -> bytes | None:
        """One poll: the file's content when it differs from the applied one, is not empty and
        read the same twice `settle_s` apart; else None. Blocks for `settle_s` when the file
        changed, so async callers run it with `asyncio.to_thread`."""
        self.num_polls += 1
        now = read_fingerprint(self.path)
        if now is None or not now.strip() or now == self._applied:
            return None
        if self.settle_s:
            time.sleep(self.settle_s)
        if read_fingerprint(self.path) != now:
            self.num_unsettled += 1
            return None
        self.repeated = now == self._rejected
        return now

    def accept(self, content: bytes) -> None:
        """`content` (from `poll`) parsed and is now in force."""
        self._applied = content
        self._rejected = None
        self.applied_at_poll = self.num_polls

    def reject(self, content: bytes) -> None:
        """`content` (from `poll`) did not parse: the config in force stays; polls hand it out
        again until the file changes."""
        self._rejected = content
