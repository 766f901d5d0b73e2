"""The metric source: PromQL templates, the Prometheus HTTP API, the /cache/stats fallback.
Real HTTP servers on loopback (small stand-ins that speak the same JSON)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from kvfleet_operator.api import CacheStatsSource, MetricsSpec
from kvfleet_operator.metrics import (
    DeploymentPods,
    pod_regex,
    read_cache_stats,
    read_hit_rates,
    render_query,
)

Responder = Callable[[str, dict[str, list[str]]], Any]


@pytest.fixture
def http_server() -> Iterator[Callable[[Responder], int]]:
    servers: list[ThreadingHTTPServer] = []

    def start(respond: Responder) -> int:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                body = json.dumps(respond(url.path, parse_qs(url.query))).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield start
    for server in servers:
        server.shutdown()


def test_pod_regex_matches_exactly_the_pods_that_exist() -> None:
    regex = re.compile(pod_regex(["llm-canary-7d9f8b6c5-x2x9z", "llm-canary-7d9f8b6c5-aaaaa"]))
    assert regex.fullmatch("llm-canary-7d9f8b6c5-x2x9z")
    assert regex.fullmatch("llm-canary-7d9f8b6c5-aaaaa")
    # A previous rollout's canary: same Deployment, another ReplicaSet, pods already deleted.
    assert not regex.fullmatch("llm-canary-5c4b3a291-x2x9z")
    assert not regex.fullmatch("llm-7d9f8b6c5-x2x9z")


def test_query_template_substitution() -> None:
    pods = DeploymentPods("ns", "llm", (), ("llm-7d9f8b6c5-b", "llm-7d9f8b6c5-a", "x.y"))
    text = render_query('x{namespace="${namespace}",d="${deployment}",pod=~"${pod_regex}"}', pods)
    assert text == 'x{namespace="ns",d="llm",pod=~"llm-7d9f8b6c5-a|llm-7d9f8b6c5-b|x\\\\.y"}'


def test_prometheus_is_asked_per_deployment(http_server: Callable[[Responder], int]) -> None:
    asked: list[str] = []

    def respond(path: str, query: dict[str, list[str]]) -> Any:
        assert path == "/api/v1/query"
        promql = query["query"][0]
        asked.append(promql)
        if "kvfleet_cache_lookup_tokens_total" not in promql:
            return {
                "status": "success",
                "data": {
                    "resultType": "vector",
                    "result": [{"metric": {}, "value": [0, "1234.5"]}],
                },
            }
        value = "0.25" if "canary" in promql else "0.6"
        return {
            "status": "success",
            "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]},
        }

    port = http_server(respond)
    spec = MetricsSpec.model_validate({"prometheus": {"url": f"http://127.0.0.1:{port}"}})
    reading = read_hit_rates(
        spec,
        DeploymentPods("ns", "llm", (), ("llm-1-a",)),
        DeploymentPods("ns", "llm-canary", (), ("llm-canary-1-a",)),
    )
    assert (reading.target_hit_rate, reading.canary_hit_rate) == (0.6, 0.25)
    assert reading.target_saved_prefill_tokens_per_s == 1234.5
    assert reading.source == "prometheus"
    assert len(asked) == 3


def test_a_hit_rate_is_never_read_above_one(http_server: Callable[[Responder], int]) -> None:
    """Two windowed rates, extrapolated each on its own, can divide to a little over 1 near a full
    hit rate: read as 1 (a BASELINE of 100.2% is a lie). The saved-prefill rate is not a ratio:
    read as it is."""

    def respond(path: str, query: dict[str, list[str]]) -> Any:
        promql = query["query"][0]
        value = "5000.5" if "matched_tokens_total{" in promql and "/" not in promql else (
            "1.002" if "canary" not in promql else "-0.001")
        return {"status": "success",
                "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]}}

    port = http_server(respond)
    spec = MetricsSpec.model_validate({"prometheus": {"url": f"http://127.0.0.1:{port}"}})
    reading = read_hit_rates(spec, DeploymentPods("ns", "llm", (), ("llm-1-a",)),
                             DeploymentPods("ns", "llm-canary", (), ("llm-canary-1-a",)))
    assert (reading.target_hit_rate, reading.canary_hit_rate) == (1.0, 0.0)
    assert reading.target_saved_prefill_tokens_per_s == 5000.5


def test_nan_and_empty_results_are_no_data(http_server: Callable[[Responder], int]) -> None:
    def respond(path: str, query: dict[str, list[str]]) -> Any:
        result = [] if "canary" in query["query"][0] else [{"metric": {}, "value": [0, "NaN"]}]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    port = http_server(respond)
    spec = MetricsSpec.model_validate(
        {"prometheus": {"url": f"http://127.0.0.1:{port}"}, "cacheStats": {"enabled": False}}
    )
    reading = read_hit_rates(
        spec,
        DeploymentPods("ns", "llm", (), ("llm-1-a",)),
        DeploymentPods("ns", "llm-canary", (), ("llm-canary-1-a",)),
    )
    assert (reading.target_hit_rate, reading.canary_hit_rate) == (None, None)


def test_a_deployment_without_pods_is_not_asked_about(
    http_server: Callable[[Responder], int],
) -> None:
    asked: list[str] = []

    def respond(path: str, query: dict[str, list[str]]) -> Any:
        asked.append(query["query"][0])
        return {"status": "success",
                "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "0.5"]}]}}

    port = http_server(respond)
    spec = MetricsSpec.model_validate(
        {"prometheus": {"url": f"http://127.0.0.1:{port}"}, "cacheStats": {"enabled": False}}
    )
    reading = read_hit_rates(
        spec, DeploymentPods("ns", "llm", (), ("llm-1-a",)), DeploymentPods("ns", "llm-canary", ())
    )
    assert (reading.target_hit_rate, reading.canary_hit_rate) == (0.5, None)
    assert asked and all("llm-canary" not in q for q in asked)


def test_unreachable_prometheus_falls_back_to_cache_stats(
    http_server: Callable[[Responder], int],
) -> None:
    def stats(path: str, query: dict[str, list[str]]) -> Any:
        assert path == "/cache/stats"
        return {"totals": {"num_lookup_tokens": 1000, "num_matched_tokens": 600}}

    port = http_server(stats)
    spec = MetricsSpec.model_validate(
        {
            "prometheus": {"url": "http://127.0.0.1:9", "timeoutSeconds": 0.5},
            "cacheStats": {"port": port},
        }
    )
    reading = read_hit_rates(
        spec,
        DeploymentPods("ns", "llm", ("127.0.0.1", "127.0.0.1")),
        DeploymentPods("ns", "llm-canary", ()),
    )
    assert reading.source == "cache-stats"
    assert reading.target_hit_rate == pytest.approx(0.6)
    assert reading.canary_hit_rate is None  # no pods answered: no data, not zero


class _StatsPods:
    """One loopback server standing in for `num_pods` replica pods at the same address: every
    request must be in flight at once (a barrier), then the first `num_good` arrivals answer real
    counters, the next one answers garbage, and the rest hang until `release` is set."""

    def __init__(self, num_pods: int, num_good: int) -> None:
        self.barrier = threading.Barrier(num_pods, timeout=30)
        self.release = threading.Event()
        self.guard = threading.Lock()
        self.num_arrived = self.num_in_flight = self.max_in_flight = 0
        pods = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with pods.guard:
                    arrival = pods.num_arrived
                    pods.num_arrived += 1
                    pods.num_in_flight += 1
                    pods.max_in_flight = max(pods.max_in_flight, pods.num_in_flight)
                try:
                    pods.barrier.wait()
                    if arrival < num_good:
                        body = {"totals": {"num_matched_tokens": 30, "num_lookup_tokens": 100}}
                        payload = json.dumps(body).encode()
                    elif arrival == num_good:
                        payload = b"not json"
                    else:
                        pods.release.wait(30)
                        payload = b"{}"
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(payload)
                except (threading.BrokenBarrierError, OSError):
                    pass
                finally:
                    with pods.guard:
                        pods.num_in_flight -= 1

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.barrier.abort()
        self.server.shutdown()


def test_cache_stats_asks_every_pod_at_once_within_one_budget() -> None:
    """Six pods: three answer, one answers garbage, two never answer. The read asks all six at
    once (each request waits at the server until all six are in flight, which a pod-by-pod read
    would never reach) and returns while the two silent pods' requests are still open: one budget
    for the whole read, not one timeout per pod."""
    pods = _StatsPods(num_pods=6, num_good=3)
    try:
        source = CacheStatsSource(port=pods.port, timeout_seconds=1.0)
        rate = read_cache_stats(source, ["127.0.0.1"] * 6)
        with pods.guard:
            still_open = pods.num_in_flight
        assert rate == 90 / 300
        assert pods.max_in_flight == 6 and pods.num_arrived == 6
        assert still_open == 2  # the silent pods, skipped and not waited for
    finally:
        pods.close()


def test_cache_stats_of_no_pods_is_no_data() -> None:
    assert read_cache_stats(CacheStatsSource(port=1), []) is None
