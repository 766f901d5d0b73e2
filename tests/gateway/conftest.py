"""A real Envoy as a GIE gateway configures it, `kvfleet epp` (in a thread of its own) and real
replicas on loopback (`ServerThread`: the tiny checkpoint, the router secret, their names)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from kvfleet_lab.gateway import EnvoyGateway, envoy_binary
from kvfleet_runtime.epp import EppServer, EppState
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.server import ReplicaAuth, build_replica
from kvfleet_runtime.server._config import ReplicaConfig
from kvfleet_runtime.tokenizer import load_tokenizer
from tests.router.conftest import KEYS
from tests.runtime.server.conftest import OPERATOR_TOKEN, ROUTER_SECRET, TEST_CONFIG, ServerThread
from tests.support import free_port


class EppThread:
    """`kvfleet epp`'s server in its own thread and event loop (the openai client is sync)."""

    def __init__(self, state: EppState, grpc_port: int = 0) -> None:
        self.state = state
        self.server = EppServer(state, grpc_address=f"127.0.0.1:{grpc_port}",
                                http_host="127.0.0.1", http_port=free_port())
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="epp-under-test", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            await self.server.start()
            self._started.set()
            await self._stop.wait()
            await self.server.stop(grace_s=1.0)

        self.loop.run_until_complete(main())
        self.loop.close()

    @property
    def grpc_port(self) -> int:
        return self.server.grpc_port

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.server.http_port}/metrics",
                                    timeout=5) as r:
            return str(r.read().decode())

    def __enter__(self) -> EppThread:
        self._thread.start()
        assert self._started.wait(60), "the EPP did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            assert self._stop is not None
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)


@dataclass
class Gateway:
    envoy: EnvoyGateway
    epp: EppThread
    replicas: dict[str, ServerThread]
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def client(self, key: str = "sk-acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.envoy.url + "/v1", api_key=key, max_retries=0)

    def name_of(self, upstream: str) -> str:
        """The replica an access log's upstream host is."""
        return next(n for n, s in self.replicas.items() if upstream == f"127.0.0.1:{s.port}")

    def mark(self) -> int:
        """How many requests the access log holds once the ones before now are in it."""
        time.sleep(0.2)
        return len(self.envoy.access_log())

    def served(self, after: int = 0, count: int = 1) -> list[dict[str, Any]]:
        """Access log entries of finished requests (index `after` on), waiting for `count` of
        them while Envoy flushes its log (every second)."""
        deadline = time.monotonic() + 10
        while True:
            entries = self.envoy.access_log()[after:]
            if len(entries) >= count or time.monotonic() > deadline:
                return entries
            time.sleep(0.05)


@pytest.fixture(scope="session")
def envoy() -> Path:
    return envoy_binary()


@pytest.fixture(scope="module")
def gateway_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    model_dir = tmp_path_factory.mktemp("gateway") / "tiny"
    generate_checkpoint(model_dir, ModelArgs.from_preset("tiny"), seed=0)
    return model_dir


def start_gateway(stack: contextlib.ExitStack, workdir: Path, model_dir: Path, envoy: Path, *,
                  replicas: int = 2, router_secret: bytes | None = ROUTER_SECRET,
                  **envoy_options: Any) -> Gateway:
    """Replicas (as the chart runs them: the router secret, their names), the EPP over them, and
    Envoy in front; everything stops with `stack`."""
    config = ReplicaConfig.model_validate({**TEST_CONFIG, "model_dir": str(model_dir)})
    servers = {f"r{i}": stack.enter_context(ServerThread(build_replica(config), ReplicaAuth(
        router_secret=router_secret, operator_token=OPERATOR_TOKEN, name=f"r{i}")))
        for i in range(replicas)}
    view = FleetView(static_replicas={n: f"http://127.0.0.1:{s.port}"
                                      for n, s in servers.items()},
                     recompute_s_per_token=1e-4)
    # As the chart runs it: the model's tokenizer, so text prompts are routed by their ids.
    state = EppState(view=view, keys=KEYS, router_secret=router_secret, poll_interval_s=0.2,
                     max_body_bytes=65536, tokenizer=load_tokenizer(model_dir))
    epp = stack.enter_context(EppThread(state))
    gw = EnvoyGateway.for_pool(workdir, epp_address=("127.0.0.1", epp.grpc_port),
                               endpoints=[("127.0.0.1", s.port) for s in servers.values()],
                               **envoy_options)
    gw.binary = envoy
    stack.callback(gw.stop)
    gw.start()
    return Gateway(gw, epp, servers)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, gateway_model: Path, envoy: Path
            ) -> Iterator[Gateway]:
    with contextlib.ExitStack() as stack:
        yield start_gateway(stack, tmp_path_factory.mktemp("envoy"), gateway_model, envoy)
