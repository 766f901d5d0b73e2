"""Kubeconfig helpers: what a minted identity's kubeconfig copies from the admin's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.cluster import kubeconfig


def test_written_kubeconfig_round_trips_and_is_private(tmp_path: Path) -> None:
    path = kubeconfig.write_kubeconfig(
        tmp_path / "k", kubeconfig.file_cluster("https://127.0.0.1:1", tmp_path / "ca.crt"),
        kubeconfig.token_user("t0ken"), name="who",
    )
    assert path.stat().st_mode & 0o077 == 0
    assert kubeconfig.current_cluster(path) == {
        "server": "https://127.0.0.1:1", "certificate-authority": str(tmp_path / "ca.crt"),
    }
    users = yaml.safe_load(path.read_text())["users"]
    assert users == [{"name": "who", "user": {"token": "t0ken"}}]


def test_current_cluster_follows_the_current_context_and_absolutizes_the_ca(
    tmp_path: Path,
) -> None:
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "config"
    path.write_text(yaml.safe_dump({
        "current-context": "b",
        "contexts": [{"name": "a", "context": {"cluster": "one"}},
                     {"name": "b", "context": {"cluster": "two"}}],
        "clusters": [{"name": "one", "cluster": {"server": "https://one"}},
                     {"name": "two", "cluster": {"server": "https://two",
                                                 "certificate-authority": "ca.pem"}}],
    }))
    assert kubeconfig.current_cluster(path) == {
        "server": "https://two", "certificate-authority": str(tmp_path / "conf" / "ca.pem"),
    }


def test_current_cluster_without_a_context_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(ValueError, match=str(path)):
        kubeconfig.current_cluster(path)
