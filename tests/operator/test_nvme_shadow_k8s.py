"""Against the real API server: the fleet's shadow-mode NVMe figure crossing the break-even flips
the tier within one reconcile, and the policy status shows measured vs profile vs break-even.

The reconcile runs in process with the admin credential. The cluster's pods are kwok's (nothing
runs in them, their IPs lead nowhere), so the one injected part is where a load report is read:
the operator asks for `http://<podIP>:<replicaPort>/fleet/v1/load` and the test answers each of
those URLs from a real HTTP server on loopback serving the load-report section a replica's own
`BandwidthRecorder` produces."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import config as kube_config

from kvfleet_operator.handlers import reconcile_policy
from kvfleet_operator.kube import Kube
from kvfleet_runtime.breakeven import GB
from kvfleet_runtime.config.fleet import parse_fleet_config
from kvfleet_runtime.nvme import BandwidthRecorder
from kvfleet_runtime.wire import LOAD_PATH
from tests.cluster.fixtures import Cluster
from tests.operator.conftest import apply, get, replica_deployment

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


class Replicas:
    """A loopback HTTP server answering load reports with a settable T3 bandwidth."""

    def __init__(self) -> None:
        self.per_read_gbps = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                rec = BandwidthRecorder()
                for _ in range(20):  # 20 reads at concurrency 4
                    rec.record(4, int(outer.per_read_gbps * GB), 1.0)
                body = json.dumps({"nvme": {"mode": "shadow", "read_bandwidth": {
                    str(k): v for k, v in rec.snapshot().items()}}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.asked: list[str] = []

    def read(self, urls: Sequence[str]) -> list[dict[str, Any]]:
        self.asked = list(urls)
        port = self.server.server_address[1]
        out = []
        for _ in urls:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{LOAD_PATH}", timeout=5) as r:
                out.append(json.loads(r.read())["nvme"]["read_bandwidth"])
        return out


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    r = Replicas()
    r.thread.start()
    yield r
    r.server.shutdown()


def test_measured_nvme_bandwidth_crossing_the_break_even_flips_the_tier(
    installed: Cluster, k8s_namespace: str, replicas: Replicas
) -> None:
    ns = k8s_namespace
    kube = Kube(kube_config.new_client_from_config(str(installed.kubeconfig)))
    apply(installed, ns, replica_deployment("llm", 2))
    installed.kubectl("rollout", "status", "-n", ns, "deployment/llm", "--timeout=90s")
    apply(installed, ns, {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "KVCachePolicy",
        "metadata": {"name": "kv"},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "replicaPort": 8123,
                 "tiers": {"nvme": {"shadow": True}}},
    })

    def nvme_status() -> dict[str, Any]:
        st = get(installed, ns, "kvcachepolicy", "kv")["status"]
        return dict(next(t for t in st["tiers"] if t["tier"] == "nvme"))

    def published() -> bool:
        cm = get(installed, ns, "configmap", "kv-fleet")
        return parse_fleet_config(cm["data"]["fleet.yaml"]).tiers.nvme

    replicas.per_read_gbps = 6.0  # below the 9.26 GB/s break-even
    reconcile_policy(kube, ns, "kv", read_nvme=replicas.read)
    pods = get(installed, ns, "pods", "-l", "app=llm")["items"]
    assert sorted(replicas.asked) == sorted(
        f"http://{p['status']['podIP']}:8123{LOAD_PATH}" for p in pods
    )
    st = nvme_status()
    assert st["enabled"] is False and published() is False
    assert st["reason"] == (
        "break-even 9.26 GB/s vs measured 6 GB/s: off (capacity only: not for interactive)"
    )
    assert (st["profileGBps"], st["measuredGBps"]) == (7.0, 6.0)
    assert st["measurement"] == (
        "shadow: 2 replica(s), 40 reads, per-read bandwidth at p95 concurrency 4"
    )
    assert get(installed, ns, "kvcachepolicy", "kv")["status"]["breakEvenGBps"] == 9.264

    replicas.per_read_gbps = 11.0  # crosses it: one reconcile flips the tier and publishes it
    reconcile_policy(kube, ns, "kv", read_nvme=replicas.read)
    st = nvme_status()
    assert st["enabled"] is True and published() is True
    assert st["reason"] == "break-even 9.26 GB/s vs measured 11 GB/s: on"

    replicas.per_read_gbps = 9.0  # and back below: off again at the next reconcile
    reconcile_policy(kube, ns, "kv", read_nvme=replicas.read)
    assert nvme_status()["enabled"] is False and published() is False
