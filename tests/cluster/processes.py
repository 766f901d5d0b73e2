"""Child processes of the test cluster: one process group each, a log file each, bounded waits.

Every component starts in its own session (so its process group id is its PID) and asks the
kernel to SIGKILL it if the Python process that started it dies: a pytest killed by CI or by
`kill -9` leaves no etcd or apiserver behind. Teardown signals each group by that PID, SIGTERM
first, SIGKILL after a grace period, and reaps the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 40


class ComponentError(RuntimeError):
    """A component did not start, died, or did not become ready in time."""


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL me when my parent dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(slots=True)
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def describe_failure(self, what: str) -> str:
        state = "running" if self.alive() else f"exited with code {self.popen.returncode}"
        return (
            f"{self.name} (pid {self.pid}, {state}): {what}\n"
            f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after grace_s, reap the child."""
        if self.popen.returncode is not None:
            return
        _signal_group(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=grace_s)
        # The leader is gone; anything it forked into its group goes too.
        _signal_group(self.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def start_process(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
) -> ManagedProcess:
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            # Not thread-safe in general; we start components from one thread only.
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )
    return ManagedProcess(name, popen, log_path)


def wait_until(
    ready: Callable[[], bool], timeout_s: float, what: str, *processes: ManagedProcess
) -> None:
    """Poll `ready` until true. Fail fast if one of `processes` (those `ready` depends on) dies;
    on timeout, fail with each one's log tail."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    while True:
        for process in processes:
            if not process.alive():
                raise ComponentError(process.describe_failure(f"died while waiting for {what}"))
        if ready():
            return
        if time.monotonic() > deadline:
            message = f"{what} not ready after {timeout_s:.0f} s"
            details = [p.describe_failure(message) for p in processes] or [message]
            raise ComponentError("\n".join(details))
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 0.5)
