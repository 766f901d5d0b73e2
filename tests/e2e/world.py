"""The pieces of the e2e world that are not the cluster: loopback GPU nodes, model folders, Redis,
Prometheus, the operator process, and bounded waits that say what they waited for.

Everything here is a real program: Debian's redis-server and prometheus, `kvfleet model generate`,
`kvfleet-operator run`. Each runs in its own process group (tests/cluster/processes.py) and is
stopped by PID at teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.cluster.fixtures import Cluster, CommandError, Identity
from tests.cluster.processes import ManagedProcess, start_process
from tests.e2e.kubelet import PodProcess, http_json
from tests.support import free_port

E2E_NODE_LABEL = "kvfleet.dev/e2e-node"
NUM_E2E_NODES = 2


# `kvfleet model generate --preset tiny` (a torch import and a few MB of weights) takes ~15 s on
# 2 idle cores and has taken over 2 min on 2 cores shared with builds; past this it is stuck.
MODEL_GENERATE_S = 300.0

METRICS_TOKEN_KEY = "metrics-token"
"""The chart's `auth.metricsTokenKey` (values.yaml)."""


def wait_for(check: Callable[[], Any], what: str, timeout_s: float,
             on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll `check` until truthy; on timeout fail with `what`, the last value, `on_timeout()`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (CommandError, KeyError, TypeError, IndexError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    extra = "" if on_timeout is None else "\n" + on_timeout()
    raise AssertionError(f"{what}: not true after {timeout_s:.0f} s (last: {last!r}){extra}")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def loopback_node(index: int) -> dict[str, Any]:
    """A kwok fake GPU node whose pods get loopback IPs (127.77.<index>.0/24, kwok allocates pod
    IPs from a node's spec.podCIDR), so a pod's address is one this machine can listen on."""
    name = f"kvfleet-e2e-{index}"
    cidr = f"127.77.{index}.0/24"
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {E2E_NODE_LABEL: "true", "kubernetes.io/hostname": name,
                       "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                       "type": "kwok", "nvidia.com/gpu.present": "true"},
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {"capacity": resources, "allocatable": resources},
    }


def create_loopback_nodes(cluster: Cluster) -> list[str]:
    names = []
    for i in range(NUM_E2E_NODES):
        node = loopback_node(i)
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(node))
        names.append(node["metadata"]["name"])

    def ready() -> bool:
        nodes = json.loads(cluster.kubectl("get", "nodes", "-l", E2E_NODE_LABEL,
                                           "-o", "json").stdout)["items"]
        return len(nodes) == NUM_E2E_NODES and all(
            any(c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions", []))
            and not any(t["key"].startswith("node.kubernetes.io/")
                        for t in n["spec"].get("taints", []))
            for n in nodes
        )

    wait_for(ready, "the loopback e2e nodes Ready and untainted", 60)
    return names


def generate_model(models: Path, seed: int, attn_impl: str = "eager") -> str:
    """`kvfleet model generate` into models/<digest> (the chart's folder-per-digest layout)."""
    staging = models / f"staging-{seed}-{attn_impl}"
    kvfleet = Path(sys.executable).with_name("kvfleet")
    argv = [str(kvfleet), "model", "generate", "--out", str(staging), "--preset", "tiny",
            "--seed", str(seed), "--attn-impl", attn_impl]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=MODEL_GENERATE_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`kvfleet model generate --seed {seed}` did not finish in "
                           f"{MODEL_GENERATE_S:.0f} s (load average {_load()}); it takes about "
                           "15 s on 2 idle cores") from None
    if done.returncode != 0:
        raise RuntimeError(f"`kvfleet model generate --seed {seed}` exited {done.returncode}:\n"
                           f"{done.stderr.strip()[-2000:]}")
    out = done.stdout.split()
    digest = out[-1]
    assert digest.startswith("sha256:"), out
    # The replica pods run as uid 10001 and read this folder through a hostPath; safetensors
    # writes the weights 0600 (owner root), which a pod could not open.
    for path in staging.iterdir():
        path.chmod(0o644)
    staging.rename(models / digest)
    return digest


class Redis:
    """redis-server on a free loopback port, no persistence."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port("0.0.0.0")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.process = start_process("redis", [
            binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
            "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru",
        ], log_dir)

        def pong() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_for(pong, f"redis-server on port {self.port}", 20, self.process.log_tail)

    def close(self) -> None:
        self.process.stop()


class Prometheus:
    """Debian's prometheus scraping the replica processes' /metrics every second. Targets come
    from the kubelet shim (what kubernetes_sd + the chart's ServiceMonitor would give: the pod's
    IP and container port, with `namespace` and `pod` labels)."""

    def __init__(self, work_dir: Path) -> None:
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        self.targets = work_dir / "targets.json"
        self.targets.write_text("[]")
        self.token = work_dir / "metrics-token"
        self.token.write_text("")
        config = work_dir / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "kvfleet-replica",
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}],
                # Per-tenant series only for the chart's scrape token (docs/security.md), as
                # its ServiceMonitor presents it; copied from a replica's Secret volume.
                "authorization": {"type": "Bearer", "credentials_file": str(self.token)},
            }],
        }))
        self.port = free_port("0.0.0.0")
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = start_process("prometheus", [
            binary, f"--config.file={config}", f"--storage.tsdb.path={work_dir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
        ], work_dir)
        wait_for(lambda: http_json(f"{self.url}/-/ready")[0] == 200,
                 f"prometheus {self.url}/-/ready", 60, self.process.log_tail)

    def set_targets(self, pods: list[PodProcess]) -> None:
        for pod in pods:
            for volume in pod.live:
                for key, path in volume.items or []:
                    if volume.kind == "Secret" and key == METRICS_TOKEN_KEY and (
                            volume.local / path).exists():
                        self.token.write_bytes((volume.local / path).read_bytes())
        groups = [{"targets": [f"{p.ip}:{p.port}"],
                   "labels": {"namespace": p.namespace, "pod": p.name}}
                  for p in pods if p.port is not None]
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets)

    def query(self, promql: str) -> list[dict[str, Any]]:
        import urllib.parse

        status, body = http_json(f"{self.url}/api/v1/query?"
                                 + urllib.parse.urlencode({"query": promql}))
        assert status == 200, body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def close(self) -> None:
        self.process.stop()


class OperatorProcess:
    """`kvfleet-operator run` acting as the chart's operator ServiceAccount (a kubeconfig minted
    for it by the fixture), in place of the chart's operator pod (kwok runs no container)."""

    def __init__(self, identity: Identity, log_dir: Path, name: str, priority: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
        env.update(
            KUBECONFIG=str(identity.kubeconfig),
            KVFLEET_OPERATOR_ROLLOUT_INTERVAL_S="1",
            KVFLEET_OPERATOR_POLICY_INTERVAL_S="2",
        )
        script = Path(sys.executable).with_name("kvfleet-operator")
        self.process: ManagedProcess = start_process(
            name, [str(script), "run", "--priority", str(priority), "--verbose"], log_dir, env=env)
        wait_for(lambda: "'configure' succeeded" in self.log() or not self.process.alive(),
                 f"operator {name} startup", 90, self.process.log_tail)
        assert self.process.alive(), self.process.log_tail()

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, no warning: what a node loss or an OOM kill does."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.popen.wait(10)

    def stop(self) -> None:
        self.process.stop()


def kubectl_table(cluster: Cluster, namespace: str, *what: str) -> str:
    return cluster.kubectl("get", "-n", namespace, *what).stdout.rstrip()


def events(cluster: Cluster, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector",
        f"involvedObject.kind={kind},involvedObject.name={name}", "-o", "json",
    ).stdout)["items"]
    items.sort(key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                              e["metadata"]["creationTimestamp"]))
    return items


def elapsed(since: float) -> str:
    return f"{time.monotonic() - since:.0f}s"
