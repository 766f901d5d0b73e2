"""`replica.engine: vllm`: the replica pods run `vllm serve` with kvfleet's KV connector, keyed
like a kvfleet replica (the pod template's weights digest, the served model name), with the
connector's host pool in the pod's /dev/shm. Asserted on what `helm template` renders; the extra
config keys are checked against the connector's own list (kvfleet_vllm._options)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvfleet_operator.constants import ENGINE_ANNOTATION, PEER_PORT_ANNOTATION
from kvfleet_runtime.auth import ROUTER_SECRET_FILE
from kvfleet_runtime.picker._kv_subscriber import TOPIC
from kvfleet_vllm import _options
from tests.chart.conftest import Render, kvfleet_cli_params, run_helm, template_args

VLLM = "vllm-values.yaml"
DIGEST = "sha256:4f1c7fb2a0c94f7c6b57e2a1d5b3e8c9a0f1e2d3c4b5a69788796a5b4c3d2e1f"


def _replica(render: Render, *values: str, set: tuple[str, ...] = ()) -> dict[str, Any]:
    deployment = render(*values, set=set).get("Deployment", "kvfleet-replica")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "replica"
    return {"deployment": deployment, "container": container}


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_vllm_replicas_run_vllm_serve_with_the_connector(render: Render) -> None:
    c = _replica(render, VLLM)["container"]
    assert c["image"] == "example.org/kvfleet-vllm:0.33.0"
    assert c["command"] == ["vllm"]
    args = c["args"]
    assert args[:2] == ["serve", "/models/$(KVFLEET_WEIGHTS_DIGEST)"]
    assert _flag(args, "--served-model-name") == "llama-3.1-8b"
    assert _flag(args, "--port") == "8000"
    assert _flag(args, "--tensor-parallel-size") == "2"  # replica.gpu.count
    config = json.loads(_flag(args, "--kv-transfer-config"))
    assert config["kv_connector"] == _options.NAME
    assert config["kv_connector_module_path"] == _options.MODULE_PATH
    assert config["kv_role"] == "kv_both"
    extra = config["kv_connector_extra_config"]
    assert extra == {
        "kvfleet.host_pool_path": _options.DEFAULT_HOST_POOL_PATH,
        "kvfleet.num_host_blocks": 4096,
        "kvfleet.default_tenant": "default",
        # the router's secret, to verify the cache_salt the router signs per tenant
        "kvfleet.salt_secret_file": str(ROUTER_SECRET_FILE),
        "kvfleet.model_id": "llama-3.1-8b",
        # the kubelet expands it from the env: the digest a ModelRollout sets is the key's
        "kvfleet.weights_digest": "$(KVFLEET_WEIGHTS_DIGEST)",
        # T2 in the connector (replica.vllm.peerPort's default)
        "kvfleet.peer_port": 8701,
    }
    assert {k.removeprefix(_options.PREFIX) for k in extra} <= _options.EXTRA_KEYS
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVFLEET_WEIGHTS_DIGEST"] == DIGEST


def test_a_failed_kv_load_recomputes_instead_of_failing_the_request(render: Render) -> None:
    """vLLM's own default kv_load_failure_policy is "fail": a KV load that fails (a host pool
    block gone bad, a peer lost mid-fetch) fails the request. The chart sets "recompute", as the
    tests' and the lab's servers do: a cache fault costs the prefill, never the answer."""
    c = _replica(render, VLLM)["container"]
    config = json.loads(_flag(c["args"], "--kv-transfer-config"))
    assert config["kv_load_failure_policy"] == "recompute"


def test_vllm_replicas_probe_vllms_health_endpoint(render: Render) -> None:
    c = _replica(render, VLLM)["container"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_vllm_replicas_keep_the_fleet_wiring_and_the_host_pool_in_shm(render: Render) -> None:
    out = _replica(render, VLLM)
    pod = out["deployment"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["kvfleet.dev/weights-digest"] == DIGEST
    mounts = {m["name"]: m["mountPath"] for m in out["container"]["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    assert mounts["model"] == "/models"
    # the router selects replica pods by the same labels whatever their engine
    default = _replica(render, "default-values.yaml")["deployment"]
    assert pod["metadata"]["labels"] == default["spec"]["template"]["metadata"]["labels"]
    assert "command" not in default["spec"]["template"]["spec"]["containers"][0]


def test_vllm_engine_needs_its_image(helm: Path, helm_env: dict[str, str]) -> None:
    result = run_helm(helm, helm_env,
                      *template_args([VLLM], ["replica.vllm.image.repository="]))
    assert result.returncode != 0
    assert "replica.vllm.image.repository is required with replica.engine vllm" in result.stderr


def test_unknown_engine_is_refused_by_the_schema(helm: Path, helm_env: dict[str, str]) -> None:
    result = run_helm(helm, helm_env, *template_args([VLLM], ["replica.engine=sglang"]))
    assert result.returncode != 0 and "engine" in result.stderr, result.stderr


def test_vllm_replicas_mount_the_salt_secret_and_name_their_engine(render: Render) -> None:
    """The connector verifies each request's cache_salt with the router secret: the file its
    extra config names is the router secret's mount; the pod says it is vLLM (the operator copies
    that into the fleet config, where the router reads it)."""
    out = _replica(render, VLLM)
    pod = out["deployment"]["spec"]["template"]
    config = json.loads(_flag(out["container"]["args"], "--kv-transfer-config"))
    secret_file = Path(config["kv_connector_extra_config"]["kvfleet.salt_secret_file"])
    mount = next(m for m in out["container"]["volumeMounts"]
                 if m["mountPath"] == str(secret_file.parent))
    assert mount["readOnly"] is True
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "kvfleet-auth"
    assert volume["secret"]["items"] == [{"key": "router-secret", "path": secret_file.name}]
    assert pod["metadata"]["annotations"][ENGINE_ANNOTATION] == "vllm"
    default = _replica(render, "default-values.yaml")["deployment"]["spec"]["template"]
    assert default["metadata"]["annotations"][ENGINE_ANNOTATION] == "kvfleet"


def test_vllm_replicas_serve_t2_on_the_peer_port_and_say_where(render: Render) -> None:
    """T2 of a vLLM replica is the connector's server on `kvfleet.peer_port`: the container
    names that port, registers its URL in the hint index (KVFLEET_PEER_URL, after POD_IP so the
    kubelet expands it), tells the operator (which writes the fleet config's peer_url) and lets
    peers, and only peers, reach it."""
    out = _replica(render, VLLM, set=("replica.vllm.peerPort=9100",))
    c, pod = out["container"], out["deployment"]["spec"]["template"]
    config = json.loads(_flag(c["args"], "--kv-transfer-config"))
    assert config["kv_connector_extra_config"]["kvfleet.peer_port"] == 9100
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "http": 8000, "peer": 9100, "kv-events": 5557}
    names = [e["name"] for e in c["env"]]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVFLEET_PEER_URL"] == "http://$(POD_IP):9100"
    assert names.index("POD_IP") < names.index("KVFLEET_PEER_URL")
    assert pod["metadata"]["annotations"][PEER_PORT_ANNOTATION] == "9100"

    netpol = render(VLLM, set=("networkPolicy.enabled=true",)).get("NetworkPolicy",
                                                                    "kvfleet-replica")
    rules = netpol["spec"]["ingress"]
    peer_rules = [r for r in rules if {"port": "peer", "protocol": "TCP"} in r["ports"]]
    assert len(peer_rules) == 1
    # from the replica pods alone: the Deployment's own selector, no router, no operator
    (source,) = peer_rules[0]["from"]
    assert source == {"podSelector": {"matchLabels": out["deployment"]["spec"]["selector"][
        "matchLabels"]}}
    assert peer_rules[0]["ports"] == [{"port": "peer", "protocol": "TCP"}]


def test_a_peer_port_equal_to_the_api_port_is_refused(helm: Path, helm_env: dict[str, str]) -> None:
    result = run_helm(helm, helm_env, *template_args([VLLM], ["replica.vllm.peerPort=8000"]))
    assert result.returncode != 0
    assert "replica.vllm.peerPort must differ from replica.port" in result.stderr


def test_kvfleet_replicas_have_no_separate_peer_port(render: Render) -> None:
    """A kvfleet replica serves T2 on its API port: nothing of the vLLM peer port renders."""
    out = _replica(render, "default-values.yaml")
    c, pod = out["container"], out["deployment"]["spec"]["template"]
    assert [p["name"] for p in c["ports"]] == ["http"]
    assert "KVFLEET_PEER_URL" not in {e["name"] for e in c["env"]}
    assert PEER_PORT_ANNOTATION not in pod["metadata"]["annotations"]
    netpol = render("default-values.yaml", set=("networkPolicy.enabled=true",)).get(
        "NetworkPolicy", "kvfleet-replica")
    ports = [p["port"] for rule in netpol["spec"]["ingress"] for p in rule["ports"]]
    assert "peer" not in ports


def _router_params(render: Render, *values: str, set: tuple[str, ...] = ()) -> dict[str, Any]:
    router = render(*values, set=set).get("Deployment", "kvfleet-router")
    (container,) = router["spec"]["template"]["spec"]["containers"]
    # what the router's own command line makes of the chart's arguments
    return kvfleet_cli_params(container["args"])


def test_vllm_replicas_publish_kv_events_and_the_router_follows_them(render: Render) -> None:
    """One value (`replica.vllm.kvEvents.port`) is the port vLLM's ZMQ publisher binds in each
    replica pod, the container's `kv-events` port, and the port the router subscribes to at
    every vLLM replica of the fleet config; the topic is the one the subscriber takes."""
    out = _replica(render, VLLM, set=("replica.vllm.kvEvents.port=6123",))
    c = out["container"]
    config = json.loads(_flag(c["args"], "--kv-events-config"))
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:6123", "topic": TOPIC}
    assert {"name": "kv-events", "containerPort": 6123, "protocol": "TCP"} in c["ports"]
    params = _router_params(render, VLLM, set=("replica.vllm.kvEvents.port=6123",))
    assert params["kv_events_port"] == 6123
    assert not params["kv_events"]
    # the default port, the same in both pods
    default = _replica(render, VLLM)["container"]
    port = json.loads(_flag(default["args"], "--kv-events-config"))["endpoint"].rsplit(":")[-1]
    assert _router_params(render, VLLM)["kv_events_port"] == int(port) == 5557


def test_only_the_routers_reach_the_kv_event_port(render: Render) -> None:
    """The events say what each replica caches (tenants' tokens): one ingress rule opens the
    `kv-events` port, to the router pods alone; no other rule names it."""
    out = render(VLLM, set=("networkPolicy.enabled=true",))
    rules = out.get("NetworkPolicy", "kvfleet-replica")["spec"]["ingress"]
    kv_rules = [r for r in rules if any(p["port"] == "kv-events" for p in r["ports"])]
    assert len(kv_rules) == 1
    assert kv_rules[0]["ports"] == [{"port": "kv-events", "protocol": "TCP"}]
    (source,) = kv_rules[0]["from"]
    router = out.get("Deployment", "kvfleet-router")
    assert source == {"podSelector": {"matchLabels": router["spec"]["selector"]["matchLabels"]}}
    replica_labels = out.get("Deployment", "kvfleet-replica")["spec"]["template"]["metadata"][
        "labels"]
    assert not source["podSelector"]["matchLabels"].items() <= replica_labels.items()


@pytest.mark.parametrize("values, set", [
    (VLLM, ("replica.vllm.kvEvents.enabled=false",)),
    ("default-values.yaml", ()),  # a kvfleet replica publishes no such stream
])
def test_no_kv_events_when_switched_off_or_not_vllm(render: Render, values: str,
                                                    set: tuple[str, ...]) -> None:
    out = _replica(render, values, set=set)
    assert "--kv-events-config" not in out["container"]["args"]
    assert "kv-events" not in {p["name"] for p in out["container"]["ports"]}
    assert _router_params(render, values, set=set)["kv_events_port"] is None
    netpol = render(values, set=(*set, "networkPolicy.enabled=true")).get(
        "NetworkPolicy", "kvfleet-replica")
    assert "kv-events" not in {p["port"] for r in netpol["spec"]["ingress"] for p in r["ports"]}


@pytest.mark.parametrize("port", ["8000", "8701"])
def test_a_kv_event_port_equal_to_another_port_is_refused(helm: Path, helm_env: dict[str, str],
                                                          port: str) -> None:
    result = run_helm(helm, helm_env,
                      *template_args([VLLM], [f"replica.vllm.kvEvents.port={port}"]))
    assert result.returncode != 0
    assert "replica.vllm.kvEvents.port must differ" in result.stderr
