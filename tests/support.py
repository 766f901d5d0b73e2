"""Test helpers that several test packages share: loopback ports, a settable clock and the tiny
checkpoint. Imports only the standard library and pytest at module level, because tests/vllm and
tests/vllm_serve import it from vLLM's own environments."""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port never handed out before in this session: the kernel may give the same
    ephemeral port to two calls in a row, and two replicas told one port make the second fail to
    bind while its readiness probe reaches the first."""
    for _ in range(64):
        with contextlib.closing(socket.socket()) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no fresh loopback port in 64 tries")


@dataclass
class FakeClock:
    """A clock the test sets: pass it where the code takes a `clock` callable."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "tiny" preset's checkpoint (seed 0), written once per session and only read after."""
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint

    out = tmp_path_factory.mktemp("tiny")
    generate_checkpoint(out, ModelArgs.from_preset("tiny"), seed=0)
    return out
