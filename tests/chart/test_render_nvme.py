"""The chart's T3 volume: off by default; on, an emptyDir bounded by `replica.nvme.sizeGiB` (or
the given volume source) mounted where the replica's store is configured, with the same bound as
the store's capacity, in the replica's own config keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfleet_runtime.server import load_config
from tests.chart.conftest import Render, run_helm, template_args

DEFAULT = "default-values.yaml"


def _replica(render: Render, *sets: str) -> dict[str, Any]:
    return render(DEFAULT, set=sets).get("Deployment", "kvfleet-replica")


def _parts(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    pod = obj["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "replica"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    return volumes, mounts, env


def test_no_t3_volume_by_default(render: Render) -> None:
    volumes, mounts, env = _parts(_replica(render))
    assert "nvme" not in volumes and "nvme" not in mounts
    assert not [k for k in env if "NVME" in k]


def test_t3_on_an_emptydir_bounded_by_its_size(render: Render) -> None:
    volumes, mounts, env = _parts(
        _replica(render, "replica.nvme.enabled=true", "replica.nvme.sizeGiB=40")
    )
    assert volumes["nvme"] == {"name": "nvme", "emptyDir": {"sizeLimit": "40Gi"}}
    assert mounts["nvme"] == {"name": "nvme", "mountPath": "/var/lib/kvfleet/nvme"}
    assert env["KVFLEET_REPLICA_CACHE__NVME_PATH"] == "/var/lib/kvfleet/nvme"
    assert env["KVFLEET_REPLICA_CACHE__NVME_CAPACITY_BYTES"] == str(40 << 30)
    # The replica reads exactly these keys (and the same bound) into its config.
    cfg = load_config(environ={k: v for k, v in env.items() if k.startswith("KVFLEET_REPLICA_")})
    assert cfg.cache.nvme_path == "/var/lib/kvfleet/nvme"
    assert cfg.cache.nvme_capacity_bytes == 40 << 30


def test_t3_on_a_hostpath(render: Render) -> None:
    volumes, mounts, _ = _parts(_replica(
        render, "replica.nvme.enabled=true", "replica.nvme.volume.hostPath.path=/mnt/nvme0/kv",
        "replica.nvme.mountPath=/nvme",
    ))
    assert volumes["nvme"] == {"name": "nvme", "hostPath": {"path": "/mnt/nvme0/kv"}}
    assert mounts["nvme"]["mountPath"] == "/nvme"


def test_bad_t3_values_are_refused_by_the_schema(
    helm: Path, helm_env: dict[str, str]
) -> None:
    for bad in ("replica.nvme.sizeGiB=0", "replica.nvme.sizeBytes=5", "replica.nvme.mountPath=x"):
        result = run_helm(helm, helm_env, *template_args((DEFAULT,), [bad]))
        assert result.returncode != 0, bad
        assert "nvme" in result.stderr, result.stderr
