"""vLLM replicas, as the operator sees them: the pod template's `kvfleet.dev/engine` (the chart
sets it from `replica.engine`) is the one source. It reaches the router through the fleet config
(`ReplicaEndpoint.engine`) and picks the rollout gate's default queries (vLLM's own prefix-cache
counters plus the connector's). The queries themselves run against a real Prometheus scraping
vLLM's exporter in tests/vllm/test_hit_rate_gate.py; here, a loopback stand-in records what the
gate asks."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from kvfleet_operator.api import DEFAULT_HIT_RATE_QUERY, MetricsSpec, PrometheusSource
from kvfleet_operator.constants import ENGINE_ANNOTATION, PEER_PORT_ANNOTATION
from kvfleet_operator.handlers import engine_of, peer_port_of, pod_to_replica
from kvfleet_operator.metrics import (
    VLLM_HIT_RATE_QUERY,
    VLLM_SAVED_PREFILL_QUERY,
    DeploymentPods,
    queries_for,
    read_hit_rates,
)
from kvfleet_operator.planning import build_fleet_config, decide_tiers
from kvfleet_runtime.config.fleet import dump_fleet_config, parse_fleet_config
from tests.operator.test_fleet import SPEC

RUNNING = {"phase": "Running", "podIP": "10.0.0.9",
           "conditions": [{"type": "Ready", "status": "True"}]}


@pytest.mark.parametrize(("annotations", "engine"), [
    ({ENGINE_ANNOTATION: "vllm"}, "vllm"), ({ENGINE_ANNOTATION: "kvfleet"}, "kvfleet"),
    ({}, "kvfleet"), (None, "kvfleet"), ({ENGINE_ANNOTATION: "sglang"}, "kvfleet"),
])
def test_the_engine_comes_from_the_pod_annotation(annotations: Any, engine: str) -> None:
    meta = {"name": "llm-0", "annotations": annotations}
    assert engine_of(meta) == engine
    assert pod_to_replica({"metadata": meta, "status": RUNNING}).engine == engine


def test_the_fleet_config_tells_the_router_which_replicas_are_vllm() -> None:
    pods = [pod_to_replica({"metadata": {"name": name, "annotations": annotations},
                            "status": {**RUNNING, "podIP": ip}})
            for name, ip, annotations in (("llm-v", "10.0.0.1", {ENGINE_ANNOTATION: "vllm"}),
                                          ("llm-k", "10.0.0.2", {}))]
    config = build_fleet_config("ns/kv", 1, SPEC, decide_tiers(SPEC), pods)
    assert {r.name: r.engine for r in config.replicas} == {"llm-k": "kvfleet", "llm-v": "vllm"}
    text = dump_fleet_config(config)
    assert parse_fleet_config(text) == config
    # kvfleet is left out of the text: readers that predate the field still read kvfleet fleets
    written = {r["name"]: r for r in json.loads(text)["replicas"]}
    assert written["llm-v"]["engine"] == "vllm" and "engine" not in written["llm-k"]


def test_the_fleet_config_gives_vllm_replicas_their_peer_url() -> None:
    """A vLLM pod's connector serves T2 on `kvfleet.dev/peer-port` (the chart sets it): its
    endpoint's peer_url says so; a kvfleet pod has none (T2 is on its API port) and its entry's
    text keeps no peer_url key."""
    vllm = {ENGINE_ANNOTATION: "vllm", PEER_PORT_ANNOTATION: "8701"}
    pods = [pod_to_replica({"metadata": {"name": name, "annotations": annotations},
                            "status": {**RUNNING, "podIP": ip}})
            for name, ip, annotations in (("llm-v", "10.0.0.1", vllm),
                                          ("llm-k", "10.0.0.2", {}),
                                          # stray on a kvfleet pod: ignored
                                          ("llm-s", "10.0.0.3", {PEER_PORT_ANNOTATION: "8701"}))]
    config = build_fleet_config("ns/kv", 1, SPEC, decide_tiers(SPEC), pods)
    by_name = {r.name: r for r in config.replicas}
    assert by_name["llm-v"].peer_url == "http://10.0.0.1:8701"
    assert by_name["llm-v"].url == f"http://10.0.0.1:{SPEC.replica_port}"
    assert by_name["llm-k"].peer_url is None and by_name["llm-s"].peer_url is None
    text = dump_fleet_config(config)
    assert parse_fleet_config(text) == config
    written = {r["name"]: r for r in json.loads(text)["replicas"]}
    assert written["llm-v"]["peer_url"] == "http://10.0.0.1:8701"
    assert "peer_url" not in written["llm-k"] and "peer_url" not in written["llm-s"]


@pytest.mark.parametrize(("port", "expected"), [
    ("8701", 8701), ("65535", 65535), (None, None), ("", None), ("0", None), ("65536", None),
    ("-1", None), ("http", None), ("87 01", None),
])
def test_a_peer_port_annotation_that_is_not_a_port_gives_no_peer_url(
        port: str | None, expected: int | None) -> None:
    annotations = {ENGINE_ANNOTATION: "vllm"}
    if port is not None:
        annotations[PEER_PORT_ANNOTATION] = port
    assert peer_port_of({"annotations": annotations}) == expected


def test_vllm_replicas_get_vllms_default_queries_and_a_users_query_stays() -> None:
    default = PrometheusSource(url="http://prom:9090")
    assert queries_for(default, "kvfleet") == (default.hit_rate_query,
                                               default.saved_prefill_query)
    assert queries_for(default, "vllm") == (VLLM_HIT_RATE_QUERY, VLLM_SAVED_PREFILL_QUERY)
    own = PrometheusSource(url="http://prom:9090", hit_rate_query="my_rate")
    assert queries_for(own, "vllm") == ("my_rate", VLLM_SAVED_PREFILL_QUERY)
    assert default.hit_rate_query == DEFAULT_HIT_RATE_QUERY


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[str]]]:
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            promql = parse_qs(urlparse(self.path).query)["query"][0]
            asked.append(promql)
            value = "0.75" if "prefix_cache_queries" in promql else "300"
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {}, "value": [0, value]}]}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()


def test_the_gate_asks_for_a_vllm_deployments_combined_hit_rate(
    prometheus: tuple[str, list[str]]
) -> None:
    url, asked = prometheus
    spec = MetricsSpec.model_validate({"prometheus": {"url": url}})
    reading = read_hit_rates(
        spec, DeploymentPods("ns", "llm", (), ("llm-1-a",), engine="vllm"),
        DeploymentPods("ns", "llm-canary", (), ("llm-canary-1-a",), engine="vllm"))
    assert (reading.target_hit_rate, reading.canary_hit_rate) == (0.75, 0.75)
    assert reading.target_saved_prefill_tokens_per_s == 300
    pod = 'namespace="ns",pod=~"llm-1-a"'
    assert asked[0] == (
        f'(sum(rate({{__name__=~"vllm[:_]prefix_cache_hits_total",{pod}}}[1m])) + '
        f'(sum(rate(kvfleet_cache_matched_tokens_total{{{pod}}}[1m])) or vector(0))) / '
        f'sum(rate({{__name__=~"vllm[:_]prefix_cache_queries_total",{pod}}}[1m]))')
    assert 'pod=~"llm-canary-1-a"' in asked[1] and "vllm[:_]prefix_cache_hits_total" in asked[1]
    assert "[5m]" in asked[2] and "prefix_cache_queries" not in asked[2]
