"""The chart's replica and router containers, run as real processes with exactly the arguments and
environment the chart renders (paths moved under a temporary folder, the downward API and $(VAR)
references resolved as the kubelet does), on a tiny checkpoint: the router admits a tenant by the
API key from the chart's keys Secret, forwards to the replica the fleet config lists, and the
replica serves the repeated prefix from its cache. No cluster and no GPU needed."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_runtime.config.fleet import FleetConfig, ReplicaEndpoint, dump_fleet_config
from tests.chart.conftest import Render
from tests.support import free_port

pytestmark = pytest.mark.slow

POD_NAME = "kvfleet-replica-7d9f6c5b4-x2x4q"
API_KEY = "sk-acme-1"


def _kubelet_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        else:
            value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        env[item["name"]] = value
    return env


def _kubelet_args(container: dict[str, Any], env: dict[str, str], root: Path) -> list[str]:
    """$(VAR) expanded, absolute paths of the pod moved under `root`."""
    out = []
    for raw in container["args"]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], raw)
        out.append(str(root) + arg if arg.startswith(("/models", "/etc/kvfleet")) else arg)
    return out


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


def _post(url: str, body: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        if _get(url)[0] == 200:
            return
        time.sleep(0.5)
    pytest.fail(f"{url} not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvfleet_runtime.cli", *args],
            env={**base, "OMP_NUM_THREADS": "1", **env}, stdout=out, stderr=subprocess.STDOUT,
        )


def test_chart_containers_serve_a_cached_prefix_through_the_router(
    render: Render, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint

    staging = tmp_path / "staging"
    digest = generate_checkpoint(staging, ModelArgs.from_preset("tiny"), seed=0)
    (tmp_path / "models").mkdir()
    staging.rename(tmp_path / "models" / digest)
    replica_port, router_port = free_port(), free_port()
    out = render(
        "default-values.yaml",
        set=[
            f"replica.model.weightsDigest={digest}", "replica.model.id=tiny",
            f"replica.port={replica_port}", f"router.port={router_port}",
            "replica.config.device=cpu", "replica.config.cpu_threads=1",
            f"router.apiKeys.tenants.acme[0]={API_KEY}",
            "redis.bundled.enabled=false",  # the embedded hint index: no Redis server here
        ],
    )

    # What the kubelet would mount: the chart's ConfigMap and Secrets, and the operator's file.
    etc = tmp_path / "etc" / "kvfleet"
    for folder in ("replica", "router", "peer", "fleet", "router-secret", "operator-token"):
        (etc / folder).mkdir(parents=True)
    (etc / "replica" / "replica.yaml").write_text(
        out.get("ConfigMap", "kvfleet-replica")["data"]["replica.yaml"]
    )
    (etc / "router" / "keys.yaml").write_text(
        out.get("Secret", "kvfleet-router-keys")["stringData"]["keys.yaml"]
    )
    (etc / "peer" / "token").write_bytes(
        base64.b64decode(out.get("Secret", "kvfleet-peer")["data"]["token"])
    )
    auth = out.get("Secret", "kvfleet-auth")["data"]
    (etc / "router-secret" / "secret").write_bytes(base64.b64decode(auth["router-secret"]))
    operator_token = base64.b64decode(auth["operator-token"]).decode()
    (etc / "operator-token" / "token").write_text(operator_token)
    replica_url = f"http://127.0.0.1:{replica_port}"
    (etc / "fleet" / "fleet.yaml").write_text(dump_fleet_config(FleetConfig(
        model_id="tiny",
        replicas=(ReplicaEndpoint(name=POD_NAME, url=replica_url, weights_digest=digest),),
        home_sets={"acme": (POD_NAME,)},
    )))

    (replica,) = out.get("Deployment", "kvfleet-replica")["spec"]["template"]["spec"]["containers"]
    env = _kubelet_env(replica, {"metadata.name": POD_NAME, "status.podIP": "127.0.0.1"})
    env = {k: str(tmp_path) + v if v.startswith("/etc/kvfleet") else v for k, v in env.items()}
    replica_log = tmp_path / "replica.log"
    processes.append(_start(_kubelet_args(replica, env, tmp_path), env, replica_log))

    router = out.get("Deployment", "kvfleet-router")["spec"]["template"]["spec"]["containers"][0]
    router_env = _kubelet_env(router, {})
    router_env = {k: str(tmp_path) + v if v.startswith("/etc/kvfleet") else v
                  for k, v in router_env.items()}
    router_log = tmp_path / "router.log"
    processes.append(
        _start(_kubelet_args(router, router_env, tmp_path), router_env, router_log)
    )

    # The chart's probes, on the ports the chart opened.
    for probe in ("livenessProbe", "readinessProbe"):
        path = replica[probe]["httpGet"]["path"]
        _wait_ready(f"{replica_url}{path}", processes[0], replica_log, 180)
        path = router[probe]["httpGet"]["path"]
        _wait_ready(f"http://127.0.0.1:{router_port}{path}", processes[1], router_log, 60)

    _, ready = _get(f"{replica_url}/readyz")
    assert ready["weights_digest"] == digest  # the folder of the digest the chart pinned
    prompt = "You are the ACME support assistant. Answer briefly and politely. " * 3
    cached = []
    for i in range(3):
        status, body = _post(
            f"http://127.0.0.1:{router_port}/v1/completions",
            {"model": "tiny", "prompt": f"{prompt} Question {i}?", "max_tokens": 2,
             "temperature": 0},
            API_KEY,
        )
        assert status == 200, (body, router_log.read_text()[-2000:])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    # Stored on its second sighting, served from cache on the third.
    assert cached[0] == 0 and cached[2] >= 16, cached
    status, _ = _post(
        f"http://127.0.0.1:{router_port}/v1/completions", {"prompt": "x"}, "sk-unknown"
    )
    assert status == 401
    # The replica refuses a tenant claimed by anyone but the router, and shows a tenant's stats
    # only to the operator's token (the chart's generated Secret, mounted in both).
    request = urllib.request.Request(
        f"{replica_url}/v1/completions", data=json.dumps({"prompt": "x"}).encode(),
        method="POST", headers={"Content-Type": "application/json", "X-Kvfleet-Tenant": "acme"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401
    assert _get(f"{replica_url}/cache/stats?tenant=acme")[0] == 401
    request = urllib.request.Request(f"{replica_url}/cache/stats?tenant=acme",
                                     headers={"Authorization": f"Bearer {operator_token}"})
    stats = yaml.safe_load(urllib.request.urlopen(request, timeout=5).read())
    assert stats["totals"]["num_matched_tokens"] == sum(cached)
