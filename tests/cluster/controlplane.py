"""A throwaway Kubernetes control plane on loopback, built from real components.

Start order and why:
  1. etcd on a temp data dir (fsync off: the data dies with the session anyway);
  2. kube-apiserver on a random 127.0.0.1 port, TLS from pki.py, client-certificate and
     ServiceAccount-token authentication, RBAC authorization; we wait for /readyz;
  3. kube-controller-manager (one ServiceAccount per controller, as in production, so RBAC is
     exercised; it signs tokens and publishes the root CA), kube-scheduler and kwok, together;
  4. FAKE_NODE_COUNT Node objects that kwok keeps Ready and whose pods it turns Running. Each
     advertises GPUS_PER_NODE `nvidia.com/gpu`, so GPU requests schedule as on a real fleet.
The cluster is Ready when the nodes are Ready and untainted and the `default` ServiceAccount
exists (the sign that the controller-manager runs).

Every wait is bounded and names what did not become ready, with the tail of that component's log.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster import kubeconfig
from tests.cluster.binaries import Binaries
from tests.cluster.pki import ClientSubject, Pki, make_pki
from tests.cluster.processes import ComponentError, ManagedProcess, start_process, wait_until
from tests.support import free_port

FAKE_NODE_COUNT = 3
GPUS_PER_NODE = 8
GPU_RESOURCE = "nvidia.com/gpu"
FAKE_NODE_LABEL = "kvfleet.dev/fake-node"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"

# Client identities, one certificate each. kwok plays the kubelet of every fake node at once, so
# it cannot be a single system:node:<name>; it gets the admin group, like kwokctl's own clusters.
CLIENTS = {
    "admin": ClientSubject("kvfleet-admin", ("system:masters",)),
    "controller-manager": ClientSubject("system:kube-controller-manager"),
    "scheduler": ClientSubject("system:kube-scheduler"),
    "kwok": ClientSubject("kvfleet-kwok", ("system:masters",)),
}

ETCD_READY_S = 30.0
APISERVER_READY_S = 60.0
COMPONENT_READY_S = 30.0
NODES_READY_S = 60.0


@dataclass(frozen=True, slots=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


def free_ports() -> Ports:
    """Distinct free loopback ports (`free_port` never hands one out twice)."""
    return Ports(*(free_port() for _ in range(5)))


class _Http:
    """GETs and POSTs on loopback; never through a proxy from the environment."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)

    def request(self, url: str, body: Any = None) -> tuple[int, bytes]:
        """(status, body); status 0 when nothing answered (not listening yet)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with self._opener.open(req, timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (OSError, urllib.error.URLError):
            return 0, b""


def fake_node(index: int) -> dict[str, Any]:
    name = f"kwok-gpu-{index}"
    resources = {"cpu": "32", "memory": "256Gi", "pods": "110", GPU_RESOURCE: str(GPUS_PER_NODE)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            # kwok manages only nodes with this annotation (see its --manage-nodes-with-... flag).
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                FAKE_NODE_LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def _node_ready(node: dict[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    # TaintNodesByCondition marks new nodes not-ready until the node controller sees them Ready.
    taints = node.get("spec", {}).get("taints") or []
    return ready and not any(t.get("key", "").startswith("node.kubernetes.io/") for t in taints)


class LocalControlPlane:
    """Owns the processes and files of one cluster under `work_dir`; see the module docstring."""

    def __init__(self, binaries: Binaries, work_dir: Path) -> None:
        self.binaries = binaries
        self.work_dir = work_dir
        self.ports = free_ports()
        self.api_url = f"https://127.0.0.1:{self.ports.apiserver}"
        self.log_dir = work_dir / "logs"
        self.pki_dir = work_dir / "pki"
        self.admin_kubeconfig = work_dir / "admin.kubeconfig"
        self.processes: list[ManagedProcess] = []
        self.fake_nodes = tuple(fake_node(i)["metadata"]["name"] for i in range(FAKE_NODE_COUNT))

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start every component and wait for a Ready cluster; on failure, stop what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        # Reverse order: clients first, etcd last, so nothing logs a storm of lost connections.
        for process in reversed(self.processes):
            process.stop()

    def _start(self) -> None:
        self.log_dir.mkdir(parents=True)  # creates work_dir too
        pki = make_pki(self.pki_dir, CLIENTS)
        kubeconfigs = {
            name: kubeconfig.write_kubeconfig(
                self.work_dir / f"{name}.kubeconfig",
                kubeconfig.file_cluster(self.api_url, pki.ca.cert),
                kubeconfig.cert_user(pair.cert, pair.key),
                name=f"kvfleet-test-{name}",
            )
            for name, pair in pki.clients.items()
        }
        self._start_etcd()
        admin = self._admin_http(pki)
        self._start_apiserver(pki, admin)
        for index in range(FAKE_NODE_COUNT):
            status, body = admin.request(f"{self.api_url}/api/v1/nodes", fake_node(index))
            if status not in (201, 409):
                raise ComponentError(f"creating fake node {index}: HTTP {status}: {body[:300]!r}")
        manager = self._start_controller_manager(pki, kubeconfigs["controller-manager"])
        scheduler = self._start_scheduler(kubeconfigs["scheduler"])
        kwok = self._start_kwok(kubeconfigs["kwok"])
        _wait_healthz(manager, self.ports.controller_manager)
        _wait_healthz(scheduler, self.ports.scheduler)
        # kwok marks the nodes Ready; the controller-manager then lifts their not-ready taint.
        wait_until(lambda: self._nodes_ready(admin), NODES_READY_S,
                   f"{FAKE_NODE_COUNT} fake nodes Ready and untainted", kwok, manager)
        sa_url = f"{self.api_url}/api/v1/namespaces/default/serviceaccounts/default"
        wait_until(lambda: admin.request(sa_url)[0] == 200, COMPONENT_READY_S,
                   "ServiceAccount default/default (created by the controller-manager)", manager)

    # -- components ------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        process = start_process(name, argv, self.log_dir)
        self.processes.append(process)
        return process

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports.etcd_client}"
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        process = self._spawn("etcd", [
            str(self.binaries.etcd),
            "--name=test",
            f"--data-dir={self.work_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ])
        http = _Http(None)
        wait_until(lambda: b'"true"' in http.request(f"{client}/health")[1],
                   ETCD_READY_S, f"etcd {client}/health", process)

    def _start_apiserver(self, pki: Pki, admin: _Http) -> None:
        process = self._spawn("kube-apiserver", [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self.ports.etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports.apiserver}",
            f"--cert-dir={self.work_dir / 'apiserver'}",
            f"--tls-cert-file={pki.serving.cert}",
            f"--tls-private-key-file={pki.serving.key}",
            f"--client-ca-file={pki.ca.cert}",
            f"--service-account-key-file={pki.sa_public_key}",
            f"--service-account-signing-key-file={pki.sa_private_key}",
            f"--service-account-issuer={SA_ISSUER}",
            "--authorization-mode=RBAC",
            # Endpoints may not hold a loopback address, so the `kubernetes` Service's endpoints
            # cannot be 127.0.0.1; rather than fail to write them every 10 s, write none (no pod
            # here dials the API through the Service: kwok's pods run nothing).
            "--endpoint-reconciler-type=none",
            # The front-proxy CA: without it every delegating component (controller-manager,
            # scheduler) logs a missing CA bundle every few seconds. No client is allowed to
            # assert request headers unless its certificate says kvfleet-front-proxy.
            f"--requestheader-client-ca-file={pki.ca.cert}",
            "--requestheader-allowed-names=kvfleet-front-proxy",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
        ])
        wait_until(lambda: admin.request(f"{self.api_url}/readyz")[0] == 200,
                   APISERVER_READY_S, f"kube-apiserver {self.api_url}/readyz", process)

    def _serving_flags(self, name: str, port: int, config: Path) -> list[str]:
        """Loopback-only health endpoint; delegated authn/authz through the component's identity."""
        return [
            f"--kubeconfig={config}",
            f"--authentication-kubeconfig={config}",
            f"--authorization-kubeconfig={config}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--leader-elect=false",  # one instance: no need to wait for a lease
            f"--cert-dir={self.work_dir / name}",
        ]

    def _start_controller_manager(self, pki: Pki, config: Path) -> ManagedProcess:
        return self._spawn("kube-controller-manager", [
            str(self.binaries.kube_controller_manager),
            *self._serving_flags("controller-manager", self.ports.controller_manager, config),
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.sa_private_key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--cluster-signing-cert-file={pki.ca.cert}",
            f"--cluster-signing-key-file={pki.ca.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--profiling=false",
        ])

    def _start_scheduler(self, config: Path) -> ManagedProcess:
        return self._spawn("kube-scheduler", [
            str(self.binaries.kube_scheduler),
            *self._serving_flags("scheduler", self.ports.scheduler, config),
            "--profiling=false",
        ])

    def _start_kwok(self, config: Path) -> ManagedProcess:
        return self._spawn("kwok", [
            str(self.binaries.kwok),
            f"--kubeconfig={config}",
            # Explicit config: never pick up a developer's ~/.kwok/kwok.yaml.
            f"--config={self.binaries.kwok_stages}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            # Leases are the nodes' heartbeats; without them the node controller evicts pods.
            "--node-lease-duration-seconds=40",
            f"--cidr={POD_CIDR}",
            "--node-ip=10.240.0.1",
        ])

    # -- probes ----------------------------------------------------------------------------

    def _admin_http(self, pki: Pki) -> _Http:
        context = ssl.create_default_context(cafile=str(pki.ca.cert))
        admin = pki.clients["admin"]
        context.load_cert_chain(str(admin.cert), str(admin.key))
        return _Http(context)

    def _nodes_ready(self, admin: _Http) -> bool:
        status, body = admin.request(f"{self.api_url}/api/v1/nodes?labelSelector={FAKE_NODE_LABEL}")
        if status != 200:
            return False
        nodes = json.loads(body).get("items") or []
        return len(nodes) == FAKE_NODE_COUNT and all(_node_ready(n) for n in nodes)


def _wait_healthz(process: ManagedProcess, port: int) -> None:
    # The controller-manager and scheduler serve /healthz with self-signed certificates.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    http = _Http(context)
    url = f"https://127.0.0.1:{port}/healthz"
    wait_until(lambda: http.request(url)[0] == 200, COMPONENT_READY_S,
               f"{process.name} {url}", process)
