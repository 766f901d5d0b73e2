"""The chart's security wiring, rendered by the real helm: the NetworkPolicies (selectors and
ports), the generated auth and Redis Secrets and who mounts which key, Redis AUTH, and the
runtime's own settings loaders on the environment the chart gives each pod."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from kvfleet_runtime.auth import read_operator_token, read_router_secret
from kvfleet_runtime.fleet.hint_index import ACL_RULES, ACL_USERS
from kvfleet_runtime.server import ReplicaAuth
from tests.chart.conftest import Render, Rendered

DEFAULT = "default-values.yaml"


def _pod(out: Rendered, name: str) -> dict[str, Any]:
    template: dict[str, Any] = out.get("Deployment", name)["spec"]["template"]
    return template


def _labels(out: Rendered, name: str) -> dict[str, str]:
    labels: dict[str, str] = _pod(out, name)["metadata"]["labels"]
    return labels


def _container(out: Rendered, name: str) -> dict[str, Any]:
    (container,) = _pod(out, name)["spec"]["containers"]
    return container


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector
    return bool(selector["matchLabels"].items() <= labels.items())


def _port_number(out: Rendered, deployment: str, port_name: str) -> int:
    (port,) = [p for p in _container(out, deployment)["ports"] if p["name"] == port_name]
    return int(port["containerPort"])


def test_replicas_accept_only_routers_peers_operator_and_the_scraper(render: Render) -> None:
    out = render(DEFAULT)
    policy = out.get("NetworkPolicy", "kvfleet-replica")["spec"]
    assert _selects(policy["podSelector"], _labels(out, "kvfleet-replica"))
    assert not _selects(policy["podSelector"], _labels(out, "kvfleet-router"))
    assert policy["policyTypes"] == ["Ingress"]
    fleet, scraper = policy["ingress"]
    http = [{"port": "http", "protocol": "TCP"}]
    assert fleet["ports"] == http and scraper["ports"] == http
    # The named port is the one port the replica serves everything on (T2 included).
    assert _port_number(out, "kvfleet-replica", "http") == 8000
    allowed = [peer["podSelector"] for peer in fleet["from"]]
    assert all(set(peer) == {"podSelector"} for peer in fleet["from"])  # this namespace only
    for name in ("kvfleet-router", "kvfleet-replica", "kvfleet-operator"):
        assert sum(_selects(sel, _labels(out, name)) for sel in allowed) == 1, name
    assert not any(_selects(sel, _labels(out, "kvfleet-redis")) for sel in allowed)
    assert scraper["from"] == [{"namespaceSelector": {},
                                "podSelector": {"matchLabels": {
                                    "app.kubernetes.io/name": "prometheus"}}}]


def test_the_scraper_selector_and_extra_rules_are_configurable(render: Render) -> None:
    out = render(DEFAULT, set=[
        "networkPolicy.metricsScraper[0].namespaceSelector.matchLabels.name=monitoring",
        "networkPolicy.replicaExtraIngress[0].from[0].ipBlock.cidr=10.9.0.0/16",
    ])
    policy = out.get("NetworkPolicy", "kvfleet-replica")["spec"]
    _, scraper, extra = policy["ingress"]
    # --set on a list replaces the whole list (helm): the scraper is now that namespace's pods.
    assert scraper["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    assert extra == {"from": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]}
    none = render(DEFAULT, set=["networkPolicy.metricsScraper=null"])
    (only,) = none.get("NetworkPolicy", "kvfleet-replica")["spec"]["ingress"]
    assert len(only["from"]) == 3


def test_router_ingress_is_open_on_its_port_unless_configured(render: Render) -> None:
    out = render(DEFAULT)
    policy = out.get("NetworkPolicy", "kvfleet-router")["spec"]
    assert _selects(policy["podSelector"], _labels(out, "kvfleet-router"))
    assert policy["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    limited = render(DEFAULT, set=[
        "networkPolicy.routerFrom[0].namespaceSelector.matchLabels.name=ingress-nginx"])
    front, scraper = limited.get("NetworkPolicy", "kvfleet-router")["spec"]["ingress"]
    assert front["from"] == [{"namespaceSelector": {"matchLabels": {"name": "ingress-nginx"}}}]
    assert scraper["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "prometheus"}


def test_network_policies_can_be_left_out(render: Render) -> None:
    out = render(DEFAULT, set=["networkPolicy.enabled=false"])
    assert [o["metadata"]["name"] for o in out.of_kind("NetworkPolicy")] == ["kvfleet-redis"]


def _secret_mount(out: Rendered, deployment: str, volume: str) -> tuple[str, str, str]:
    """(mount path, Secret name, key) of a Secret volume of a deployment's container."""
    pod = _pod(out, deployment)["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == volume]
    (item,) = vol["secret"]["items"]
    (mount,) = [m for m in _container(out, deployment)["volumeMounts"] if m["name"] == volume]
    assert mount["readOnly"] is True
    return f"{mount['mountPath']}/{item['path']}", vol["secret"]["secretName"], item["key"]


def _secret_volumes(out: Rendered, deployment: str) -> set[tuple[str, str]]:
    volumes = _pod(out, deployment)["spec"]["volumes"]
    return {(v["secret"]["secretName"], item["key"]) for v in volumes
            if "secret" in v for item in v["secret"]["items"]}


def test_each_pod_mounts_only_the_credentials_it_uses(render: Render) -> None:
    out = render(DEFAULT)
    secret = out.get("Secret", "kvfleet-auth")
    assert set(secret["data"]) == {"router-secret", "operator-token", "metrics-token"}
    router_secret, operator_token, metrics_token = (base64.b64decode(secret["data"][k]) for k in (
        "router-secret", "operator-token", "metrics-token"))
    assert len(router_secret) == len(operator_token) == len(metrics_token) == 48
    assert len({router_secret, operator_token, metrics_token}) == 3
    auth = {("kvfleet-auth", "router-secret"), ("kvfleet-auth", "operator-token"),
            ("kvfleet-auth", "metrics-token")}
    assert _secret_volumes(out, "kvfleet-replica") & auth == auth
    assert _secret_volumes(out, "kvfleet-router") & auth == {("kvfleet-auth", "router-secret")}
    assert _secret_volumes(out, "kvfleet-operator") == {("kvfleet-auth", "operator-token")}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _loaded(out: Rendered, deployment: str, tmp_path: Path) -> dict[str, str]:
    """The container's literal environment with each mounted auth file written under
    `tmp_path` from the rendered Secret (what the kubelet would mount)."""
    env = _env(_container(out, deployment))
    data = out.get("Secret", "kvfleet-auth")["data"]
    for volume, variable in (("router-secret", "KVFLEET_ROUTER_SECRET_FILE"),
                             ("operator-token", "KVFLEET_OPERATOR_TOKEN_FILE")):
        if variable not in env:
            continue
        path, secret_name, key = _secret_mount(out, deployment, volume)
        assert (env[variable], secret_name) == (path, "kvfleet-auth")
        local = tmp_path / deployment / volume
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(base64.b64decode(data[key]))
        env[variable] = str(local)
    return env


def test_the_runtime_loads_the_credentials_the_chart_mounts(
    render: Render, tmp_path: Path
) -> None:
    out = render(DEFAULT)
    data = out.get("Secret", "kvfleet-auth")["data"]
    router_secret = base64.b64decode(data["router-secret"])
    operator_token = base64.b64decode(data["operator-token"])
    replica_env = _loaded(out, "kvfleet-replica", tmp_path)
    auth = ReplicaAuth.from_env({**replica_env, "POD_NAME": "kvfleet-replica-abc"})
    assert (auth.router_secret, auth.operator_token, auth.name) == (
        router_secret, operator_token, "kvfleet-replica-abc")
    router_env = _loaded(out, "kvfleet-router", tmp_path)
    assert "KVFLEET_OPERATOR_TOKEN_FILE" not in router_env
    assert read_router_secret(router_env) == router_secret
    operator_env = _loaded(out, "kvfleet-operator", tmp_path)
    assert "KVFLEET_ROUTER_SECRET_FILE" not in operator_env
    assert read_operator_token(operator_env) == operator_token


def test_an_existing_auth_secret_replaces_the_generated_one(render: Render) -> None:
    out = render(DEFAULT, set=["auth.existingSecret=my-auth", "auth.routerSecretKey=rs"])
    assert not [o for o in out.of_kind("Secret") if o["metadata"]["name"] == "kvfleet-auth"]
    assert _secret_mount(out, "kvfleet-router", "router-secret")[1:] == ("my-auth", "rs")


def test_the_bundled_redis_requires_its_password(render: Render) -> None:
    out = render(DEFAULT)
    data = out.get("Secret", "kvfleet-redis")["data"]
    assert sorted(data) == ["password", "replica-password", "router-password"]
    assert all(len(base64.b64decode(v)) == 40 for v in data.values())
    assert len(set(data.values())) == 3
    redis = _container(out, "kvfleet-redis")
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    ref = {"secretKeyRef": {"name": "kvfleet-redis", "key": "password"}}
    env = {e["name"]: e.get("valueFrom") for e in redis["env"]}
    assert env == {  # the probe's redis-cli too
        "REDIS_PASSWORD": ref, "REDISCLI_AUTH": ref,
        "REDIS_REPLICA_PASSWORD": {"secretKeyRef": {"name": "kvfleet-redis",
                                                    "key": "replica-password"}},
        "REDIS_ROUTER_PASSWORD": {"secretKeyRef": {"name": "kvfleet-redis",
                                                   "key": "router-password"}}}
    for name, role in (("kvfleet-replica", "replica"), ("kvfleet-router", "router")):
        items = _container(out, name)["env"]
        names = [e["name"] for e in items]
        # Declared before the URL that refers to it (the kubelet expands in order).
        assert names.index("KVFLEET_REDIS_PASSWORD") < names.index("KVFLEET_REDIS_URL"), name
        by_name = {e["name"]: e for e in items}
        assert by_name["KVFLEET_REDIS_PASSWORD"]["valueFrom"] == {
            "secretKeyRef": {"name": "kvfleet-redis", "key": f"{role}-password"}}
        assert by_name["KVFLEET_REDIS_URL"]["value"] == (
            f"redis://{ACL_USERS[role]}:$(KVFLEET_REDIS_PASSWORD)@kvfleet-redis:6379/0")


def test_the_bundled_redis_has_the_hint_index_acl_users(render: Render) -> None:
    """Each role's user with exactly `hint_index.ACL_RULES` (the chart's copy of them), so the
    router's credential can look up and never write (tests/runtime/fleet/test_hint_keys.py runs
    a redis-server with these rules)."""
    args = [str(a) for a in _container(render(DEFAULT), "kvfleet-redis")["args"]]
    users = [i for i, a in enumerate(args) if a == "--user"]
    assert len(users) == 2
    for start, end in zip(users, [*users[1:], len(args)], strict=True):
        name, on, password, *rules = args[start + 1:end]
        role = {v: k for k, v in ACL_USERS.items()}[name]
        assert (on, password) == ("on", f">$(REDIS_{role.upper()}_PASSWORD)")
        assert rules == ACL_RULES[role].split(), role
    legacy = render(DEFAULT, set=["redis.bundled.auth.roleUsers=false"])
    assert "--user" not in _container(legacy, "kvfleet-redis")["args"]
    url = {e["name"]: e for e in _container(legacy, "kvfleet-router")["env"]}["KVFLEET_REDIS_URL"]
    assert url["value"] == "redis://:$(KVFLEET_REDIS_PASSWORD)@kvfleet-redis:6379/0"


@pytest.mark.parametrize("overrides", [["redis.bundled.auth.enabled=false"],
                                       ["redis.bundled.auth.existingSecret=mine"]])
def test_redis_auth_can_be_off_or_an_existing_secret(render: Render,
                                                     overrides: list[str]) -> None:
    out = render(DEFAULT, set=overrides)
    assert not [o for o in out.of_kind("Secret") if o["metadata"]["name"] == "kvfleet-redis"]
    args = _container(out, "kvfleet-redis")["args"]
    assert ("--requirepass" in args) is ("mine" in overrides[0])
