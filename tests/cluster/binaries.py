"""Where build.sh put the control-plane binaries, and a clear error when it has not run.

The pinned versions live in versions.env, shared with build.sh, so the folder names agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
VERSIONS_FILE = HERE / "versions.env"


class MissingBinariesError(RuntimeError):
    """build.sh has not produced (all of) the pinned binaries on this machine."""


@dataclass(frozen=True, slots=True)
class Versions:
    kubernetes: str
    etcd: str
    kwok: str
    helm: str


@dataclass(frozen=True, slots=True)
class Binaries:
    """Absolute paths of every executable the test cluster runs; never resolved through PATH."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    kwok: Path
    kwok_stages: Path
    helm: Path


def read_versions(path: Path = VERSIONS_FILE) -> Versions:
    values: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return Versions(
        kubernetes=values["KUBERNETES_VERSION"],
        etcd=values["ETCD_VERSION"],
        kwok=values["KWOK_VERSION"],
        helm=values["HELM_VERSION"],
    )


def cluster_home() -> Path:
    """Mirrors build.sh: $KVFLEET_CLUSTER_HOME, else $KVFLEET_HOME/cluster."""
    if explicit := os.environ.get("KVFLEET_CLUSTER_HOME"):
        return Path(explicit)
    home = os.environ.get("KVFLEET_HOME") or str(Path.home() / ".cache" / "kvfleet")
    return Path(home) / "cluster"


def locate(versions: Versions | None = None, home: Path | None = None) -> Binaries:
    """Paths where build.sh puts the pinned binaries (they may not exist: see `require`)."""
    v = versions or read_versions()
    root = home or cluster_home()
    k8s = root / f"bin-kubernetes-{v.kubernetes}"
    kwok = root / f"bin-kwok-{v.kwok}"
    return Binaries(
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        etcd=root / f"bin-etcd-{v.etcd}" / "etcd",
        kwok=kwok / "kwok",
        kwok_stages=kwok / "stages.yaml",
        helm=root / f"bin-helm-{v.helm}" / "helm",
    )


def require(binaries: Binaries, *names: str) -> None:
    """Raise MissingBinariesError, with the command that builds them, if any named file is absent.

    With no names, every binary is required (a local cluster needs all of them; an existing
    cluster only kubectl and helm).
    """
    wanted = names or tuple(f.name for f in fields(binaries))
    missing = [str(getattr(binaries, n)) for n in wanted if not getattr(binaries, n).is_file()]
    if missing:
        raise MissingBinariesError(
            "the test control plane is not built on this machine; missing:\n  "
            + "\n  ".join(missing)
            + "\nbuild it once (cold: ~30 min on 2 cores; cached afterwards) with:"
            + f"\n  {BUILD_SCRIPT}"
            + "\n(`make test` runs it for you), or set KVFLEET_SKIP_K8S=1 to skip the k8s tests,"
            + " or KVFLEET_TEST_KUBECONFIG=<path> to run them against an existing cluster."
        )
