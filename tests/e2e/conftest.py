"""The e2e world for tests/e2e/test_user_path.py: one release of the chart on the real control plane
(tests/cluster), with every pod that matters backed by a real process.

How each piece runs (and why):
- Control plane: the `k8s_cluster` fixture (etcd, kube-apiserver, controller-manager, scheduler,
  kwok). Two extra kwok GPU nodes get loopback pod CIDRs (world.loopback_node); the chart's
  replicas and router are pinned to them with `nodeSelector` in the values file.
- Replica and router pods: kwok's, backed by real `kvfleet replica` / `kvfleet router` processes
  at the pods' IPs and container ports, started and stopped by the KubeletShim (kubelet.py) from
  the pods' own specs (args, env, mounted ConfigMaps and Secrets, the hostPath model volume,
  uid 10001), inside the runtime image scripts/images.sh built (`buildah run --isolation
  chroot`, read-only root): the bytes a cluster would pull, not this checkout's venv. The image
  is this checkout's build (the tag scripts/images.sh gives these sources, which another
  checkout's build cannot replace); not built, the e2e fails saying so (`make test` builds it
  first; `make images` alone does). One image tag is a fault injected for
  scenario B (kubelet.UNSTABLE_KEY_IMAGE: the same image's replica through unstable_key.py, its
  cache key nonced per request); every other pod runs as is.
- Operator: `kvfleet-operator run` as a local process (this checkout's venv) with a kubeconfig
  minted for the chart's operator ServiceAccount (so it has exactly the chart's RBAC). The chart's
  operator pod is scheduled by kwok but runs nothing: the shim runs only the runtime image, and a
  local process can be SIGKILLed and restarted by the test (the operator image is smoke-tested
  in tests/images).
- Redis: a redis-server process, given to the chart as `redis.external.url` (the bundled Redis'
  pod would need Service DNS, which this cluster does not have).
- Prometheus: Debian's binary, scraping the replica processes' /metrics; its targets come from
  the shim (what the chart's ServiceMonitor and kubernetes_sd do on a real cluster).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.cluster.fixtures import Cluster, Identity
from tests.e2e.kubelet import KubeletShim
from tests.e2e.traffic import NUM_TENANTS, Traffic, api_key, tenant_name
from tests.e2e.world import (
    E2E_NODE_LABEL,
    OperatorProcess,
    Prometheus,
    Redis,
    create_loopback_nodes,
    generate_model,
    kubectl_table,
)
from tests.images.buildah import Container, checkout_image, have_image, working_container
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
RELEASE = "kvfleet"
MODEL_ID = "tiny"
KEEP_ENV = "KVFLEET_E2E_KEEP"  # keep the work dir (logs of every process) after the run


# The chart's replica pods, by their component label.
REPLICA_LABEL = "app.kubernetes.io/component=replica"


@dataclass
class World:
    cluster: Cluster
    namespace: str
    work_dir: Path
    models: Path
    digests: dict[str, str]  # v1 (installed), v2 (new weights)
    values_file: Path
    replica_port: int
    router_port: int
    redis: Redis
    prometheus: Prometheus
    shim: KubeletShim
    operator_identity: Identity
    operators: list[OperatorProcess]
    nodes: list[str]

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return self.cluster.kubectl(*args, stdin=stdin).stdout

    def start_operator(self, name: str, priority: int) -> OperatorProcess:
        op = OperatorProcess(self.operator_identity, self.work_dir, name, priority)
        self.operators.append(op)
        return op

    def logs(self) -> str:
        """Where to look, for failure messages."""
        return f"process logs under {self.work_dir} (set {KEEP_ENV}=1 to keep them)"

    def error_lines(self, limit: int = 60) -> str:
        """Every process log's ERROR lines and tracebacks (exited pods' too), for a failure
        message that must say which process failed and why once the work dir is gone."""
        out: list[str] = []
        for log in sorted(self.work_dir.rglob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if "ERROR" in line or line.startswith("Traceback"):
                    out.append(f"{log.relative_to(self.work_dir)}: " + "\n    ".join(
                        lines[i : i + (14 if line.startswith("Traceback") else 1)]))
        return "\n".join(out[-limit:]) or "no ERROR lines or tracebacks in the process logs"

    def diagnostics(self, traffic: Traffic | None, *, pod_logs: bool = False) -> str:
        """What a failed wait shows: pods and rollouts, the shim's last events and errors, the
        traffic so far, each running replica pod's log tail (with `pod_logs`) and the newest
        operator's."""
        parts = [
            kubectl_table(self.cluster, self.namespace, "pods", "-o", "wide"),
            kubectl_table(self.cluster, self.namespace, "mro", "-o", "wide")
            if self.operator_identity else "",
            "shim: " + "; ".join(self.shim.events[-12:]),
            "shim errors: " + "; ".join(self.shim.errors[-5:]),
            traffic.summary(20) if traffic else "",
            self.logs(),
        ]
        if pod_logs:
            for pod in self.shim.running(REPLICA_LABEL):
                parts.append(f"{pod.name} log tail:\n{pod.process.log_tail(15)}")
        for op in self.operators[-1:]:
            parts.append("operator log tail:\n" + "\n".join(op.log().splitlines()[-15:]))
        return "\n".join(parts)


def values(world_models: Path, digest: str, replica_port: int, router_port: int,
           redis_url: str) -> dict[str, object]:
    """The values file a user writes (docs/quickstart.md step 3), for the loopback nodes and the
    tiny model."""
    on_e2e_nodes = {E2E_NODE_LABEL: "true"}
    return {
        "router": {
            "replicas": 1,
            "port": router_port,
            "nodeSelector": on_e2e_nodes,
            "apiKeys": {"tenants": {tenant_name(i): [api_key(tenant_name(i))]
                                    for i in range(NUM_TENANTS)}},
        },
        "replica": {
            "replicas": 2,
            "port": replica_port,
            "nodeSelector": on_e2e_nodes,
            "model": {
                "volume": {"hostPath": {"path": str(world_models), "type": "Directory"}},
                "id": MODEL_ID,
                "weightsDigest": digest,
            },
            "config": {"device": "cpu", "cpu_threads": 1,
                       "engine": {"num_kv_blocks": 256},
                       "cache": {"num_t1_blocks": 1024}},
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                          "limits": {"memory": "2Gi"}},
        },
        "fleetConfig": {"configMapName": "chat-fleet"},  # the policy of examples/kvcachepolicy.yaml
        "redis": {"bundled": {"enabled": False}, "external": {"url": redis_url}},
    }


@contextlib.contextmanager
def checkout_container(kind: str, prefix: str) -> Iterator[Container]:
    """A working container of this checkout's build of image `kind` (`scripts/images.sh --tag
    kind`), which pods run. Missing or stale, the e2e fails (no fall back to the host's venv):
    the make targets that run the e2e build the image first, so either is a real fault (a failed
    or skipped build, a pruned image, or a focused run after a source change)."""
    image = checkout_image(kind)
    build = "scripts/images.sh" + (" vllm" if kind == "vllm" else "")
    if not have_image(image):
        pytest.fail(f"the e2e runs pods in {image}, which is not built (or buildah is missing): "
                    f"run `{build}`, which `make test` runs before these tests", pytrace=False)
    with working_container(image, prefix=prefix) as container:
        stale = container.stale_sources()
        if stale:
            pytest.fail(f"{image} was built from other sources than this checkout's "
                        f"({len(stale)} files differ, e.g. {', '.join(stale[:3])}): run "
                        f"`{build}` to rebuild it", pytrace=False)
        yield container


@pytest.fixture(scope="module")
def runtime_image() -> Iterator[Container]:
    """The runtime image, which every kvfleet replica and router pod runs."""
    with checkout_container("runtime", "kvfleet-e2e") as container:
        yield container


@contextlib.contextmanager
def open_world(
    cluster: Cluster,
    runtime_image: Container,
    write_models: Callable[[Path], dict[str, str]],
    make_values: Callable[[Path, dict[str, str], int, int, str], dict[str, object]],
    vllm_image: Container | None = None,
) -> Iterator[World]:
    """One e2e world (the module docstring): `write_models(models)` writes the model folders and
    returns their digests by name ("v1" is installed), `make_values(models, digests, replica
    port, router port, Redis URL)` the values file; with `vllm_image`, the shim runs
    `replica.engine: vllm` pods in it."""
    if not cluster.local:
        pytest.skip("the e2e path needs the local control plane (loopback kwok nodes)")
    work_dir = Path(tempfile.mkdtemp(prefix="kvfleet-e2e-"))
    models = work_dir / "models"
    models.mkdir()
    namespace = cluster.create_namespace("llm")
    cleanup: list[object] = []
    shim: KubeletShim | None = None
    operators: list[OperatorProcess] = []
    nodes: list[str] = []
    try:
        nodes = create_loopback_nodes(cluster)
        digests = write_models(models)
        redis = Redis(work_dir)
        cleanup.append(redis)
        prometheus = Prometheus(work_dir)
        cleanup.append(prometheus)
        replica_port, router_port = free_port("0.0.0.0"), free_port("0.0.0.0")
        values_file = work_dir / "my-values.yaml"
        values_file.write_text(yaml.safe_dump(
            make_values(models, digests, replica_port, router_port, redis.url)))
        (work_dir / "pods").mkdir()
        shim = KubeletShim(
            cluster, namespace, work_dir / "pods",
            selector=f"app.kubernetes.io/instance={RELEASE}", nodes=set(nodes),
            container=runtime_image, vllm_container=vllm_image,
            on_change=lambda pods: prometheus.set_targets(
                [p for p in pods if p.labels.get("app.kubernetes.io/component") == "replica"]),
        )
        shim.start()
        # The chart creates the ServiceAccount; the identity needs it, so it is minted after the
        # install (World.operator_identity is set by the install test).
        yield World(cluster, namespace, work_dir, models, digests, values_file,
                    replica_port, router_port, redis, prometheus, shim,
                    None, operators, nodes)  # type: ignore[arg-type]
    finally:
        for op in operators:
            op.stop()
        if shim is not None:
            shim.close()
        for item in reversed(cleanup):
            item.close()  # type: ignore[attr-defined]
        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait=false", check=False)
        cluster.delete_namespace(namespace)
        for node in nodes:
            cluster.kubectl("delete", "node", node, "--ignore-not-found", check=False)
        if os.environ.get(KEEP_ENV):
            print(f"e2e work dir kept: {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


def kvfleet_models(models: Path) -> dict[str, str]:
    """v1 (installed) and v2 (new weights) of the tiny preset."""
    return {"v1": generate_model(models, seed=0), "v2": generate_model(models, seed=1)}


@pytest.fixture(scope="module")
def world(k8s_cluster: Cluster, runtime_image: Container) -> Iterator[World]:
    with open_world(k8s_cluster, runtime_image, kvfleet_models,
                    lambda models, digests, replica_port, router_port, redis_url: values(
                        models, digests["v1"], replica_port, router_port, redis_url)) as world:
        yield world


def dump(obj: object) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)[-3000:]
