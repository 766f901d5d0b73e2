"""Fixtures of the fleet-tier tests: a real redis-server on a free loopback port, real caches."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.support import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@dataclass
class RedisProcess:
    """A redis-server child: no persistence, loopback only, killed at teardown."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    password: str = ""
    """Non-empty: the server requires it (requirepass), as the chart's Redis does."""

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--protected-mode",
                "yes",
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn,
            ):
                auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
                conn.sendall(auth + b"PING\r\n")
                answer = b""
                expected = len(b"+OK\r\n+PONG\r\n") if auth else len(b"+PONG\r\n")
                while len(answer) < expected and (chunk := conn.recv(64)):
                    answer += chunk
                if answer.endswith(b"+PONG\r\n"):
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisProcess(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """One aiohttp client session per test (the peer fetchers' and the probes')."""
    async with aiohttp.ClientSession() as s:
        yield s
