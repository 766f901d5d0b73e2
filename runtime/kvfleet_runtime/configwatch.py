"""The one config-file watcher of the replica, the router and the fleet tier.

A process polls `ConfigFileWatcher.poll()` once per poll interval and re-reads its file when it
answers True: the content changed and then held still for one more poll. An editor or `kubectl cp`
truncates and then writes, and a ConfigMap volume swaps a symlink; waiting for the file to settle
means a half-written file is never parsed. A file that cannot be read counts as content (None): its
removal and its return are changes like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ConfigFileWatcher", "read_fingerprint"]


def read_fingerprint(path: Path) -> bytes | None:
    """The file's bytes, or None when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError:
        return None


@dataclass(slots=True)
class ConfigFileWatcher:
    """Settle-then-apply change detection for one file. Construct it BEFORE the first load: the
    content it starts from is what the process is assumed to have applied, so a write between the
    two is seen as a change and loaded again (harmless), never missed."""

    path: Path
    _applied: bytes | None = field(init=False)
    _pending: bytes | None = field(init=False, default=None)
    _has_pending: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._applied = read_fingerprint(self.path)

    def poll(self) -> bool:
        """One poll: True when the content differs from the applied one and equals what the
        previous poll saw (it has settled); the caller then re-reads and applies the file."""
        now = read_fingerprint(self.path)
        if now == self._applied:
            self._has_pending = False
            return False
        if self._has_pending and now == self._pending:
            self._applied = now
            self._has_pending = False
            return True
        self._pending, self._has_pending = now, True
        return False
