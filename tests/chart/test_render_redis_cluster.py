"""The chart with an existing Redis Cluster as the hint index (`redis.cluster`), rendered by the
real helm: seed URLs with AUTH from a Secret reach replicas and routers, the runtime's own
loaders accept what they get, the NetworkPolicy fences the cluster's pods, the schema refuses
mixed or unsafe settings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.chart.conftest import CI_VALUES, Render, Rendered, run_helm, template_args

CLUSTER = "redis-cluster-values.yaml"
SEEDS = ["hints-0.hints-headless:6379", "hints-1.hints-headless:6379",
         "hints-2.hints-headless:6379"]


def _container(out: Rendered, deployment: str) -> dict[str, Any]:
    (container,) = out.get("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


def _labels(out: Rendered, deployment: str) -> dict[str, str]:
    labels: dict[str, str] = out.get("Deployment", deployment)["spec"]["template"]["metadata"][
        "labels"]
    return labels


def _expanded_env(container: dict[str, Any], secrets: dict[str, str]) -> dict[str, str]:
    """The environment as the kubelet gives it: Secret keys from `secrets`, $(VAR) expanded."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                                       item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[f"{ref['name']}/{ref['key']}"]
    return env


@pytest.mark.parametrize("deployment", ["kvfleet-replica", "kvfleet-router"])
def test_replicas_and_routers_get_the_seed_urls_with_the_password(
    render: Render, deployment: str
) -> None:
    out = render(CLUSTER)
    assert not [o for o in out if o["metadata"]["name"] == "kvfleet-redis"]  # nothing bundled
    container = _container(out, deployment)
    env = {e["name"]: e for e in container["env"]}
    names = [e["name"] for e in container["env"]]
    # The password first: the kubelet expands $(VAR) only from variables defined before.
    assert names.index("KVFLEET_REDIS_PASSWORD") < names.index("KVFLEET_REDIS_CLUSTER_URLS")
    assert env["KVFLEET_REDIS_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "hints-auth", "key": "password"}}
    assert env["KVFLEET_REDIS_CLUSTER_URLS"]["value"] == ",".join(
        f"redis://:$(KVFLEET_REDIS_PASSWORD)@{seed}" for seed in SEEDS)
    assert "KVFLEET_REDIS_URL" not in env
    assert "--redis-url" not in container["args"]


def test_the_runtime_reads_the_cluster_from_what_the_chart_gives(render: Render) -> None:
    from kvfleet_runtime.fleet.fleet_tier import FleetSettings, hint_index_for, hint_index_kind
    from kvfleet_runtime.fleet.hint_index import RedisClusterHintIndex
    from tests.chart.conftest import kvfleet_cli_params

    out = render(CLUSTER)
    secrets = {"hints-auth/password": "pw-1"}
    replica_env = _expanded_env(_container(out, "kvfleet-replica"), secrets)
    # (the router secret from the environment: the mounted file does not exist here)
    settings = FleetSettings.from_env({**replica_env, "KVFLEET_PEER_SECRET": "x",
                                       "KVFLEET_ROUTER_SECRET": "rs"}, port=8000)
    assert settings is not None
    assert settings.hint_key is not None
    assert settings.redis_cluster_urls == tuple(f"redis://:pw-1@{seed}" for seed in SEEDS)
    index = hint_index_for(settings)
    assert hint_index_kind(index) == "redis-cluster"
    assert isinstance(index, RedisClusterHintIndex)
    assert index.hint_key == settings.hint_key
    # The router takes the same variable (its option's envvar); the chart passes no argument.
    router = _container(out, "kvfleet-router")
    assert kvfleet_cli_params(router["args"])["redis_cluster_urls"] is None
    router_env = _expanded_env(router, secrets)
    assert router_env["KVFLEET_REDIS_CLUSTER_URLS"] == ",".join(settings.redis_cluster_urls)


def test_without_a_password_the_urls_are_as_given(render: Render) -> None:
    out = render(CLUSTER, set=["redis.cluster.auth.existingSecret="])
    env = {e["name"]: e for e in _container(out, "kvfleet-replica")["env"]}
    assert "KVFLEET_REDIS_PASSWORD" not in env
    assert env["KVFLEET_REDIS_CLUSTER_URLS"]["value"] == ",".join(
        f"redis://{seed}" for seed in SEEDS)


def test_only_the_fleet_and_the_cluster_itself_reach_the_cluster(render: Render) -> None:
    out = render(CLUSTER)
    policy = out.get("NetworkPolicy", "kvfleet-redis-cluster")["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "hints"}}
    assert policy["policyTypes"] == ["Ingress"]
    fleet, own = policy["ingress"]
    allowed = [p["podSelector"]["matchLabels"] for p in fleet["from"]]
    for name in ("kvfleet-replica", "kvfleet-router"):
        assert sum(sel.items() <= _labels(out, name).items() for sel in allowed) == 1, name
    assert not any(sel.items() <= _labels(out, "kvfleet-operator").items() for sel in allowed)
    assert fleet["ports"] == [{"port": 6379, "protocol": "TCP"}]
    # Gossip and failover run over the bus port: without it the cluster could not promote.
    assert own == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "hints"}}}],
                   "ports": [{"port": 6379, "protocol": "TCP"}, {"port": 16379, "protocol": "TCP"}]}
    off = render(CLUSTER, set=["redis.cluster.networkPolicy.enabled=false"])
    assert not [o for o in off.of_kind("NetworkPolicy")
                if o["metadata"]["name"] == "kvfleet-redis-cluster"]


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["redis.bundled.enabled=true"], "bundled"),
        (["redis.external.url=redis://other:6379/0"], "external"),
        (["redis.cluster.seedUrls[0]=redis://:pw@hints-0:6379"], "credentials in values"),
        (["redis.cluster.seedUrls[0]=hints-0:6379"], "not a URL"),
        (["redis.cluster.networkPolicy.podSelector=null"], "a policy without a selector"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_the_schema_refuses(
    helm: Path, helm_env: dict[str, str], overrides: list[str], why: str
) -> None:
    assert (CI_VALUES / CLUSTER).exists()
    result = run_helm(helm, helm_env, *template_args([CLUSTER], overrides))
    assert result.returncode != 0, why
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
