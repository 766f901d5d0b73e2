"""The handle tests get for a Kubernetes cluster, and `open_cluster()`, which provides one.

`open_cluster()` starts a LocalControlPlane (controlplane.py) in a fresh temp dir, or, when
KVFLEET_TEST_KUBECONFIG names a kubeconfig, uses that existing cluster and starts nothing. Either
way it yields a `Cluster` and, on exit, stops what it started and removes its temp dir.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.cluster import kubeconfig
from tests.cluster.binaries import Binaries, locate, require
from tests.cluster.controlplane import LocalControlPlane
from tests.cluster.processes import ComponentError

EXISTING_KUBECONFIG_ENV = "KVFLEET_TEST_KUBECONFIG"
KEEP_LOGS_ENV = "KVFLEET_K8S_KEEP_LOGS"
TEST_NAMESPACE_LABEL = "kvfleet.dev/test-namespace"
COMMAND_TIMEOUT_S = 120.0
NAMESPACE_READY_S = 30.0
START_ATTEMPTS = 2
_WORK_DIR_PREFIX = "kvfleet-cluster-"


class CommandError(RuntimeError):
    """kubectl or helm exited non-zero (or timed out); the message carries its stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"{' '.join(self.argv)} exited {returncode}:\n{stderr.strip()[-2000:]}")


def _run(
    argv: Sequence[str], env: dict[str, str], stdin: str | None, check: bool, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, env=env, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        raise CommandError(argv, -1, "", f"timed out after {timeout_s:.0f} s") from exc
    if check and result.returncode != 0:
        raise CommandError(argv, result.returncode, result.stdout, result.stderr)
    return result


@dataclass(frozen=True, slots=True)
class _Tools:
    """The kubectl and helm binaries plus per-session state dirs, so nothing touches ~/.kube."""

    kubectl: Path
    helm: Path
    state_dir: Path

    def env(self, config: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(config)
        for name in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            env[name] = str(self.state_dir / name.lower())
        return env

    def kubectl_argv(self, config: Path, args: Sequence[str]) -> list[str]:
        cache = self.state_dir / "kube-cache"
        return [str(self.kubectl), f"--kubeconfig={config}", f"--cache-dir={cache}", *args]


@dataclass(frozen=True, slots=True)
class Identity:
    """A restricted identity: a ServiceAccount's token in its own kubeconfig."""

    username: str  # system:serviceaccount:<namespace>:<name>
    kubeconfig: Path
    token: str
    _tools: _Tools

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True,
        timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """kubectl as this identity (see Cluster.kubectl)."""
        argv = self._tools.kubectl_argv(self.kubeconfig, args)
        return _run(argv, self._tools.env(self.kubeconfig), stdin, check, timeout_s)


@dataclass(frozen=True, slots=True)
class Cluster:
    """A reachable cluster and the tools to drive it as its admin.

    kubeconfig: admin kubeconfig. api_url: the API server's URL. local: True when this session
    started the cluster. gpu_nodes: names of the fake nodes advertising nvidia.com/gpu (empty for
    an existing cluster). work_dir: a per-session temp dir, removed at the end.
    """

    kubeconfig: Path
    api_url: str
    local: bool
    gpu_nodes: tuple[str, ...]
    work_dir: Path
    _tools: _Tools

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True,
        timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl as admin. Raises CommandError on a non-zero exit if check."""
        argv = self._tools.kubectl_argv(self.kubeconfig, args)
        return _run(argv, self._tools.env(self.kubeconfig), stdin, check, timeout_s)

    def helm(
        self, *args: str, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm as admin, with its cache/config/data dirs in work_dir."""
        argv = [str(self._tools.helm), *args]
        return _run(argv, self._tools.env(self.kubeconfig), None, check, timeout_s)

    def mint_identity(
        self, namespace: str, service_account: str, *, duration_s: int = 3600
    ) -> Identity:
        """Create (if absent) the ServiceAccount, get a token from the TokenRequest API, and
        write a kubeconfig that authenticates with it. Bind Roles to
        `system:serviceaccount:<namespace>:<service_account>` to grant it anything."""
        exists = self.kubectl("get", "serviceaccount", service_account, "-n", namespace,
                              check=False)
        if exists.returncode != 0:
            self.kubectl("create", "serviceaccount", service_account, "-n", namespace)
        token = self.kubectl(
            "create", "token", service_account, "-n", namespace, f"--duration={duration_s}s"
        ).stdout.strip()
        path = self.work_dir / "identities" / f"{namespace}.{service_account}.kubeconfig"
        path.parent.mkdir(exist_ok=True)
        username = f"system:serviceaccount:{namespace}:{service_account}"
        kubeconfig.write_kubeconfig(
            path, kubeconfig.current_cluster(self.kubeconfig), kubeconfig.token_user(token),
            name=username.replace(":", "-"),
        )
        return Identity(username, path, token, self._tools)

    def create_namespace(self, hint: str) -> str:
        """A new namespace named after `hint` plus a random suffix, ready for pods (its
        `default` ServiceAccount exists)."""
        stem = re.sub(r"[^a-z0-9-]+", "-", hint.lower()).strip("-")[:40].strip("-") or "test"
        name = f"{stem}-{secrets.token_hex(3)}"
        self.kubectl("create", "namespace", name)
        self.kubectl("label", "namespace", name, f"{TEST_NAMESPACE_LABEL}=true")
        deadline = time.monotonic() + NAMESPACE_READY_S
        while self.kubectl("get", "serviceaccount", "default", "-n", name,
                           check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"namespace {name}: no default ServiceAccount after "
                                   f"{NAMESPACE_READY_S:.0f} s (is the controller-manager up?)")
            time.sleep(0.2)
        return name

    def delete_namespace(self, name: str) -> None:
        """Start deleting; do not wait (a local cluster is discarded at session end anyway)."""
        self.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def _sweep_stale_work_dirs(root: Path) -> None:
    """Remove work dirs of sessions that died without teardown (the PID is in the name)."""
    for path in root.glob(f"{_WORK_DIR_PREFIX}*-*"):
        pid_text = path.name[len(_WORK_DIR_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _keep_logs(plane: LocalControlPlane, work_dir: Path) -> None:
    """Copy the logs to $KVFLEET_K8S_KEEP_LOGS/<work dir>/<plane>/ (one folder per start)."""
    target = os.environ.get(KEEP_LOGS_ENV)
    if target and plane.log_dir.is_dir():
        destination = Path(target) / work_dir.name / plane.work_dir.name
        shutil.copytree(plane.log_dir, destination, dirs_exist_ok=True)


@contextmanager
def open_cluster(binaries: Binaries | None = None) -> Iterator[Cluster]:
    """Yield a Cluster (local or existing, see the module docstring); clean up on exit.

    Raises MissingBinariesError when build.sh has not run, ComponentError when a component
    fails to become ready.
    """
    bins = binaries or locate()
    existing = os.environ.get(EXISTING_KUBECONFIG_ENV)
    require(bins, *(("kubectl", "helm") if existing else ()))
    temp_root = Path(tempfile.gettempdir())
    _sweep_stale_work_dirs(temp_root)
    work_dir = Path(tempfile.mkdtemp(prefix=f"{_WORK_DIR_PREFIX}{os.getpid()}-", dir=temp_root))
    tools = _Tools(bins.kubectl, bins.helm, work_dir / "tools")
    planes: list[LocalControlPlane] = []
    try:
        if existing:
            config = Path(existing).resolve()
            server = str(kubeconfig.current_cluster(config)["server"])
            yield Cluster(config, server, False, (), work_dir, tools)
        else:
            plane = _start_local(bins, work_dir, planes)
            yield Cluster(plane.admin_kubeconfig, plane.api_url, True, plane.fake_nodes,
                          work_dir, tools)
    finally:
        for plane in planes:
            plane.stop()
            _keep_logs(plane, work_dir)
        shutil.rmtree(work_dir, ignore_errors=True)


def _start_local(
    bins: Binaries, work_dir: Path, started: list[LocalControlPlane]
) -> LocalControlPlane:
    """Start a LocalControlPlane, once more if another process took one of its free ports
    between our probe and the component's bind (rare, but then it is nobody's bug)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        plane = LocalControlPlane(bins, work_dir / f"plane-{attempt}")
        started.append(plane)
        try:
            plane.start()
            return plane
        except ComponentError as exc:
            if attempt == START_ATTEMPTS or "address already in use" not in str(exc):
                raise
    raise AssertionError("unreachable")
