"""Fixtures for the chart tests: the real `helm` binary and a renderer that parses its output.

helm is the pinned one tests/cluster/build.sh builds (`make cluster-bins`); it is found the way the
cluster tests find it. Without it the rendering tests fail with a message saying how to get it,
unless KVFLEET_SKIP_K8S=1 (the cluster tests' opt-out), which skips them instead.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
CI_VALUES = CHART / "ci"
VERSIONS_ENV = ROOT / "tests" / "cluster" / "versions.env"

RELEASE = "kvfleet"
NAMESPACE = "inference"
MONITORING_APIS = (
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
)


def pinned_versions() -> dict[str, str]:
    """KEY=value lines of tests/cluster/versions.env (the versions build.sh builds)."""
    out = {}
    for raw in VERSIONS_ENV.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def kube_version() -> str:
    return pinned_versions()["KUBERNETES_VERSION"]


def find_helm() -> Path:
    """Where the pinned helm is (it may not exist yet): the cluster tests' path helper, or, where
    that module is absent, the same path computed from versions.env as build.sh does."""
    try:
        from tests.cluster.binaries import locate
    except ImportError:
        home = Path(os.environ.get("KVFLEET_HOME") or Path.home() / ".cache" / "kvfleet")
        cluster_home = Path(os.environ.get("KVFLEET_CLUSTER_HOME") or home / "cluster")
        return cluster_home / f"bin-helm-{pinned_versions()['HELM_VERSION']}" / "helm"
    return locate().helm


@pytest.fixture(scope="session")
def helm() -> Path:
    path = find_helm()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    message = (
        f"helm not found at {path}: build the pinned test binaries with `make cluster-bins` "
        "(tests/cluster/build.sh), or set KVFLEET_SKIP_K8S=1 to skip the tests that need them"
    )
    if os.environ.get("KVFLEET_SKIP_K8S") == "1":
        pytest.skip(message)
    pytest.fail(message)


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm's config, cache and data in a throwaway folder: the tests never touch ~/.config/helm."""
    base = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    env.update(
        HELM_CONFIG_HOME=str(base / "config"),
        HELM_CACHE_HOME=str(base / "cache"),
        HELM_DATA_HOME=str(base / "data"),
        KUBECONFIG=str(base / "no-kubeconfig"),
    )
    return env


@dataclass(frozen=True)
class Rendered:
    """The objects `helm template` printed, parsed."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)} in {self.names()}"
        return found[0]

    def names(self) -> list[str]:
        return sorted(f"{o['kind']}/{o['metadata']['name']}" for o in self.objects)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.objects)


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


def run_helm(helm: Path, env: dict[str, str], *args: str) -> HelmResult:
    proc = subprocess.run(
        [str(helm), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return HelmResult(proc.returncode, proc.stdout, proc.stderr)


Render = Callable[..., Rendered]


@pytest.fixture(scope="session")
def render(helm: Path, helm_env: dict[str, str]) -> Render:
    """render(*ci_files, set=[...], api_versions=[...]) -> Rendered; fails on a helm error."""
    cache: dict[tuple[Any, ...], Rendered] = {}

    def _render(
        *values: str,
        set: Sequence[str] = (),  # helm's own flag name
        api_versions: Sequence[str] = (),
        include_crds: bool = False,
    ) -> Rendered:
        key = (values, tuple(set), tuple(api_versions), include_crds)
        if key not in cache:
            args = template_args(values, set, api_versions, include_crds)
            result = run_helm(helm, helm_env, *args)
            assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
            docs = [d for d in yaml.safe_load_all(result.stdout) if d]
            cache[key] = Rendered(docs)
        return cache[key]

    return _render


def template_args(
    values: Sequence[str],
    set_values: Sequence[str] = (),
    api_versions: Sequence[str] = (),
    include_crds: bool = False,
) -> list[str]:
    args = [
        "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
        "--kube-version", kube_version(),
    ]
    for name in values:
        args += ["--values", str(CI_VALUES / name)]
    for item in set_values:
        args += ["--set", item]
    for api in api_versions:
        args += ["--api-versions", api]
    if include_crds:
        args.append("--include-crds")
    return args


def kvfleet_cli_params(argv: Sequence[str]) -> dict[str, Any]:
    """What the real `kvfleet` command line makes of `argv` (a subcommand, possibly nested like
    `model generate`, and its options), parsed without running it. An unknown option or a bad
    value raises."""
    import typer.main

    from kvfleet_runtime.cli import app

    command: Any = typer.main.get_command(app)
    context = command.context_class(command, info_name="kvfleet")
    args = list(argv)
    name = "kvfleet"
    while hasattr(command, "commands"):
        assert args, f"`{name}` needs a subcommand"
        name, *args = args
        sub = command.commands.get(name)
        assert sub is not None, f"`kvfleet {' '.join(argv)}`: no subcommand {name!r}"
        if hasattr(sub, "commands"):
            context = sub.context_class(sub, info_name=name, parent=context)
        command = sub
    return dict(command.make_context(name, args, parent=context).params)
