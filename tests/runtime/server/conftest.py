"""A real replica on 127.0.0.1 (its own thread and event loop) over a tiny checkpoint."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from aiohttp import web

from kvfleet_runtime.api import CANCEL_ON_DISCONNECT, AppRunner
from kvfleet_runtime.auth import sign_assertion
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.server import Replica, ReplicaAuth, build_replica, create_app, load_config
from kvfleet_runtime.wire import ASSERTION_HEADER, TENANT_HEADER

ROUTER_SECRET = b"test-router-secret"
OPERATOR_TOKEN = b"test-operator-token"
METRICS_TOKEN = b"test-metrics-token"

TEST_CONFIG: dict[str, Any] = {
    "model_id": "tiny",
    "device": "cpu",
    "config_poll_interval_s": 0.1,
    "limits": {"max_prompt_tokens": 256, "max_tokens": 32, "max_body_bytes": 65536},
    "engine": {"num_kv_blocks": 512, "max_batch_size": 16, "max_waiting": 512},
    "cache": {"t0_enabled": True, "num_t1_blocks": 512, "admit_min_sightings": 2},
}


@dataclass
class RunningReplica:
    replica: Replica
    base_url: str
    config_path: Path


def as_router(headers: dict[str, str], method: str, url: str) -> dict[str, str]:
    """`headers` plus what the router and the operator would add: a fresh tenant assertion when
    there is a tenant header and no assertion, the operator token on /cache/* without one. The
    `running` replica holds both secrets; tests of refusals send their headers themselves."""
    out = dict(headers)
    path = urllib.parse.urlsplit(url).path
    if TENANT_HEADER in out and ASSERTION_HEADER not in out:
        out[ASSERTION_HEADER] = sign_assertion(ROUTER_SECRET, out[TENANT_HEADER], audience="",
                                               method=method, path=path, now_s=time.time())
    if path.startswith("/cache/") and "Authorization" not in out:
        out["Authorization"] = "Bearer " + OPERATOR_TOKEN.decode()
    return out


class ServerThread:
    def __init__(self, replica: Replica, auth: ReplicaAuth | None = None) -> None:
        self.replica = replica
        self.auth = auth
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="replica-under-test", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        # As `kvfleet replica` serves it: a client that goes away cancels its handler.
        self.runner = AppRunner(create_app(self.replica, auth=self.auth),
                                handler_cancellation=CANCEL_ON_DISCONNECT)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._started.wait(60), "replica did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._thread.is_alive():  # already stopped (a test killed this replica)
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


@pytest.fixture(scope="session", autouse=True)
def _one_cpu_thread() -> None:
    # A tiny model on a small shared CPU: one intra-op thread is faster than a spinning team.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-server") / "tiny"
    generate_checkpoint(out, ModelArgs.from_preset("tiny"), seed=0)
    return out


@pytest.fixture(scope="session")
def running(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningReplica]:
    config_path = tmp_path_factory.mktemp("replica-config") / "replica.yaml"
    config_path.write_text(yaml.safe_dump(TEST_CONFIG))
    overrides = {"model_dir": str(model_dir)}
    config = load_config(config_path, environ={}, overrides=overrides)
    replica = build_replica(config, config_path=config_path, overrides=overrides)
    auth = ReplicaAuth(router_secret=ROUTER_SECRET, operator_token=OPERATOR_TOKEN,
                       metrics_token=METRICS_TOKEN)
    with ServerThread(replica, auth) as server:
        yield RunningReplica(replica, f"http://127.0.0.1:{server.port}", config_path)
