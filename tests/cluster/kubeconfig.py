"""Write and read the few kubeconfig shapes the test cluster needs (one cluster, one user)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def cert_user(cert: Path, key: Path) -> dict[str, str]:
    return {"client-certificate": str(cert), "client-key": str(key)}


def token_user(token: str) -> dict[str, str]:
    return {"token": token}


def file_cluster(server: str, ca: Path) -> dict[str, str]:
    return {"server": server, "certificate-authority": str(ca)}


def write_kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any], name: str) -> Path:
    """A kubeconfig with a single context `name`; readable by its owner only (it holds secrets)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def current_cluster(path: Path) -> dict[str, Any]:
    """The `cluster` entry (server, CA, TLS options) the current context of a kubeconfig uses.

    Relative certificate-authority paths are made absolute, so the entry can be copied into a
    kubeconfig written elsewhere (a minted identity's).
    """
    config = yaml.safe_load(path.read_text()) or {}
    context_name = config.get("current-context")
    contexts = {c["name"]: c["context"] for c in config.get("contexts") or []}
    clusters = {c["name"]: c["cluster"] for c in config.get("clusters") or []}
    if context_name not in contexts:
        raise ValueError(f"kubeconfig {path} has no current context (got {context_name!r})")
    cluster_name = contexts[context_name].get("cluster")
    if cluster_name not in clusters:
        raise ValueError(f"kubeconfig {path}: context {context_name!r} names no known cluster")
    cluster = dict(clusters[cluster_name])
    ca = cluster.get("certificate-authority")
    if ca and not Path(ca).is_absolute():
        cluster["certificate-authority"] = str((path.parent / ca).resolve())
    return cluster
