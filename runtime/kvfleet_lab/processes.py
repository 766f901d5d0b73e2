"""Server processes the lab benchmarks start in a process group of their own (a server and the
workers it forks): stop the whole group, read the end of its log."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["log_tail", "stop_group"]


def stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group, SIGKILL it after 60 s; nothing if it already ended."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def log_tail(log: Path, n: int = 30) -> str:
    """The last `n` lines of a server's log ("" before it exists)."""
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
