"""Helpers and fixtures of the operator's cluster tests: the CRDs and ClusterRole installed, the
operator's own ServiceAccount identity, and the operator as a subprocess acting as it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfleet_operator.constants import WEIGHTS_DIGEST_ANNOTATION
from tests.cluster.fixtures import Cluster, CommandError, Identity

ROOT = Path(__file__).resolve().parents[2]
OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64
WAIT_S = 90.0
CRDS = ("kvcachepolicies.kvfleet.dev", "modelrollouts.kvfleet.dev", "clusterkopfpeerings.kopf.dev")


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (CommandError, KeyError, TypeError, IndexError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"{what}: not true after {timeout_s:.0f} s (last: {last!r})")


def get(cluster: Cluster, ns: str, *what: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl("get", "-n", ns, *what, "-o", "json").stdout)
    return out


def apply(cluster: Cluster, ns: str, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=json.dumps(obj))


def replica_deployment(name: str, replicas: int, digest: str = OLD) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {"app": name},
                    "annotations": {WEIGHTS_DIGEST_ANNOTATION: digest},
                },
                "spec": {
                    "containers": [
                        {
                            "name": "replica",
                            "image": "registry.invalid/kvfleet:1",
                            "env": [{"name": "KVFLEET_WEIGHTS_DIGEST", "value": digest}],
                        }
                    ]
                },
            },
        },
    }


# ---------------------------------------------------------------------------------------------
# fixtures: CRDs + ClusterRole, the operator's identity, the operator process


@pytest.fixture(scope="module")
def installed(k8s_cluster: Cluster) -> Cluster:
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    for crd in CRDS:
        k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    k8s_cluster.kubectl("apply", "-f", str(ROOT / "operator" / "rbac" / "clusterrole.yaml"))
    return k8s_cluster


@pytest.fixture(scope="module")
def operator_identity(installed: Cluster) -> Iterator[Identity]:
    ns = installed.create_namespace("kvfleet-system")
    identity = installed.mint_identity(ns, "kvfleet-operator")
    binding = f"kvfleet-operator-{ns}"
    installed.kubectl(
        "create",
        "clusterrolebinding",
        binding,
        "--clusterrole=kvfleet-operator",
        f"--serviceaccount={ns}:kvfleet-operator",
    )
    yield identity
    installed.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found")
    installed.delete_namespace(ns)


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_operator(
    identity: Identity,
    log_path: Path,
    priority: int,
    policy_interval_s: float = 2,
    extra_args: tuple[str, ...] = (),
    rollout_interval_s: float = 1,
    env: dict[str, str] | None = None,
) -> OperatorProcess:
    """`kvfleet-operator run` as the operator's ServiceAccount, logging to `log_path`."""
    env = {**os.environ, **(env or {})}
    env.update(
        KUBECONFIG=str(identity.kubeconfig),
        KVFLEET_OPERATOR_ROLLOUT_INTERVAL_S=str(rollout_interval_s),
        KVFLEET_OPERATOR_POLICY_INTERVAL_S=str(policy_interval_s),
    )
    script = Path(sys.executable).with_name("kvfleet-operator")
    log = log_path.open("ab")
    proc = subprocess.Popen(
        [str(script), "run", "--priority", str(priority), "--verbose", *extra_args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    op = OperatorProcess(proc, log_path)
    wait_for(
        lambda: "'configure' succeeded" in op.log() or proc.poll() is not None,
        "operator startup",
        60,
    )
    assert proc.poll() is None, op.log()[-3000:]
    return op


@pytest.fixture(scope="module")
def operator_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("operator")


@pytest.fixture(scope="module")
def operator(operator_identity: Identity, operator_logs: Path) -> Iterator[OperatorProcess]:
    op = start_operator(operator_identity, operator_logs / "operator.log", priority=100)
    yield op
    op.stop()


_FORBIDDEN = re.compile(r'HTTP/1\.1" 403 |status=403|\(403\)|Forbidden')


def assert_no_forbidden(log: str) -> None:
    """No request of the operator was refused (urllib3's access lines, kopf's API errors).

    The one 403 that is not about RBAC is excused: a write into a namespace the test is deleting
    (NamespaceTerminating, which the operator logs on the next line and then leaves alone)."""
    lines = log.splitlines()
    bad = [
        line
        for i, line in enumerate(lines)
        if _FORBIDDEN.search(line) and "NamespaceTerminating" not in " ".join(lines[i : i + 3])
    ]
    assert not bad, "\n".join(bad[:20])
