"""Server processes the lab benchmarks start in a process group of their own (a server and the
workers it forks): a port to give one, stop the whole group, read the end of its log."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

__all__ = ["free_port", "log_tail", "stop_group"]


def free_port() -> int:
    """A free loopback port for a server the lab starts (the lab's one port picker)."""
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
