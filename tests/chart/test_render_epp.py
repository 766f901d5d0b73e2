"""router.mode epp: the router's pods run `kvfleet epp` for the cluster's GIE gateway, and the
chart renders the InferencePool naming them (the replica pods, their port, the picker's Service and
ext_proc port); the NetworkPolicies let only the gateway's pods call the picker and reach the
replicas; no API access is granted."""

from __future__ import annotations

import pytest

from tests.chart.conftest import Render, kvfleet_cli_params, run_helm, template_args
from tests.chart.test_render import DEFAULT, _container

EPP = "epp-values.yaml"


def test_the_router_pods_run_the_endpoint_picker(render: Render) -> None:
    obj = render(EPP).get("Deployment", "kvfleet-router")
    c = _container(obj, "router")
    assert c["args"][0] == "epp"
    params = kvfleet_cli_params(c["args"])  # the real CLI accepts every option
    assert (params["grpc_port"], params["http_port"], params["max_fallbacks"]) == (9002, 9090, 2)
    assert params["fleet_config"] is not None and str(params["tokenizer"]).startswith("/models/")
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 9002, "http": 9090}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert obj["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    service = render(EPP).get("Service", "kvfleet-router")
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc == {"name": "grpc", "port": 9002, "targetPort": "grpc", "protocol": "TCP",
                    "appProtocol": "kubernetes.io/h2c"}


def test_the_inference_pool_names_the_replicas_and_the_picker(render: Render) -> None:
    rendered = render(EPP, set=["router.epp.failureMode=FailOpen"])
    pool = rendered.get("InferencePool", "kvfleet")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    replicas = rendered.get("Deployment", "kvfleet-replica")
    pod_labels = replicas["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items() and selector == replicas["spec"]["selector"][
        "matchLabels"]
    port = _container(replicas, "replica")["ports"][0]["containerPort"]
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    service = rendered.get("Service", "kvfleet-router")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": service["metadata"]["name"], "port": {"number": 9002}, "failureMode": "FailOpen"}


def test_proxy_mode_renders_no_pool_and_the_router(render: Render) -> None:
    rendered = render(DEFAULT)
    assert rendered.of_kind("InferencePool") == []
    assert _container(rendered.get("Deployment", "kvfleet-router"), "router")["args"][0] == (
        "router")
    assert render(EPP, set=["router.epp.inferencePool=false"]).of_kind("InferencePool") == []


def test_only_the_gateway_calls_the_picker_and_reaches_the_replicas(render: Render) -> None:
    rendered = render(EPP)
    gateway = rendered.get("NetworkPolicy", "kvfleet-router")["spec"]["ingress"]
    grpc = [r for r in gateway if {"port": "grpc", "protocol": "TCP"} in r["ports"]]
    assert len(grpc) == 1 and grpc[0]["from"][0]["podSelector"]["matchLabels"] == {
        "gateway.envoyproxy.io/owning-gateway-name": "inference-gateway"}
    assert all("from" in r for r in gateway)  # nobody else, on any port
    replica = rendered.get("NetworkPolicy", "kvfleet-replica")["spec"]["ingress"]
    assert any(r["from"] == grpc[0]["from"] and r["ports"] == [{"port": "http", "protocol": "TCP"}]
               for r in replica)
    # The picker needs no Kubernetes API: it reads the mounted fleet config.
    for kind in ("Role", "RoleBinding", "ServiceAccount"):
        assert not [o for o in rendered.of_kind(kind) if "router" in o["metadata"]["name"]]


@pytest.mark.parametrize("mode", ["epp", "proxy-to-epp"])
def test_epp_mode_without_the_gateways_pods_is_refused(helm, helm_env, mode: str) -> None:  # type: ignore[no-untyped-def]
    values = [EPP] if mode == "epp" else [DEFAULT]
    sets = ["networkPolicy.gatewayFrom=null"] if mode == "epp" else ["router.mode=epp"]
    result = run_helm(helm, helm_env, *template_args(values, sets))
    assert result.returncode != 0
    assert "networkPolicy.gatewayFrom must name the gateway's pods" in result.stderr


def test_a_mode_outside_the_schema_is_refused_by_its_field_path(helm, helm_env) -> None:  # type: ignore[no-untyped-def]
    result = run_helm(helm, helm_env, *template_args([DEFAULT], ["router.mode=gateway"]))
    assert result.returncode != 0 and "/router/mode" in result.stderr
