"""Pytest fixtures for tests that need a real Kubernetes API (registered by tests/conftest.py).

Fixtures
  k8s_cluster    session-scoped `Cluster`: etcd, kube-apiserver, kube-controller-manager,
                 kube-scheduler and kwok with 3 fake nodes of 8 `nvidia.com/gpu` each, started on
                 127.0.0.1 (warm start: seconds), or the cluster named by KVFLEET_TEST_KUBECONFIG.
  k8s_namespace  function-scoped: the name of a fresh namespace for this test, deleted after it.

Cluster (see cluster.py)
  .kubeconfig: Path        admin kubeconfig (for kopf, the kubernetes client, subprocesses)
  .api_url: str            https://127.0.0.1:<port>
  .local: bool             started by this session (False for KVFLEET_TEST_KUBECONFIG)
  .gpu_nodes: tuple[str]   the fake GPU nodes (empty on an existing cluster)
  .kubectl(*args, stdin=None, check=True, timeout_s=120) -> CompletedProcess[str]
  .helm(*args, check=True, timeout_s=120) -> CompletedProcess[str]
  .mint_identity(namespace, service_account) -> Identity
        a ServiceAccount token from the TokenRequest API, in its own kubeconfig; Identity has
        .username, .kubeconfig, .token and .kubectl(*args, ...) acting as that account.
  .create_namespace(hint) -> str / .delete_namespace(name)
  With check=True a non-zero exit raises CommandError (its message carries stderr).

Use from another test module:

    import pytest
    from tests.cluster.fixtures import Cluster

    pytestmark = pytest.mark.k8s

    def test_apply(k8s_cluster: Cluster, k8s_namespace: str) -> None:
        k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "crds/")

Environment
  KVFLEET_SKIP_K8S=1          skip every k8s test (explicit opt-out). Without it, missing
                              binaries FAIL the k8s tests with the command that builds them.
  KVFLEET_TEST_KUBECONFIG=... run against this existing cluster instead of starting one.
  KVFLEET_K8S_KEEP_LOGS=dir   copy the components' logs there at teardown (for debugging).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.cluster.binaries import MissingBinariesError
from tests.cluster.cluster import Cluster, CommandError, Identity, open_cluster
from tests.cluster.processes import ComponentError

__all__ = ["Cluster", "CommandError", "Identity", "k8s_cluster", "k8s_namespace"]

SKIP_ENV = "KVFLEET_SKIP_K8S"
_CLUSTER_FIXTURES = {"k8s_cluster", "k8s_namespace"}


def _skip_requested() -> bool:
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses the cluster is a k8s test, marked or not (so `-m "not k8s"` works)."""
    for item in items:
        if _CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.k8s)
        if _skip_requested() and item.get_closest_marker("k8s") is not None:
            item.add_marker(pytest.mark.skip(reason=f"{SKIP_ENV} is set"))


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[Cluster]:
    """The session's cluster; see the module docstring."""
    if _skip_requested():
        pytest.skip(f"{SKIP_ENV} is set")
    stack = ExitStack()
    try:
        cluster = stack.enter_context(open_cluster())
    except (MissingBinariesError, ComponentError) as exc:
        pytest.fail(f"k8s test cluster unavailable: {exc}", pytrace=False)
    with stack:
        yield cluster


@pytest.fixture
def k8s_namespace(k8s_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for this test (named after it), deleted afterwards."""
    name = k8s_cluster.create_namespace(request.node.name)
    yield name
    k8s_cluster.delete_namespace(name)
