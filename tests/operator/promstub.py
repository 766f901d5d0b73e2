"""A real Prometheus (Debian's binary) scraping per-pod cache metrics for the rollout tests.

The pods of the test cluster are kwok's: they are Running and Ready but run no process. So each
pod's `/metrics` is served by `CacheMetricsServer` (a real HTTP server in the test process, one
path per pod) with the metric names and types the replica's cache exports
(`kvfleet_cache_lookup_tokens_total`, `kvfleet_cache_matched_tokens_total`, counters per tenant),
and Prometheus finds the pods through a file_sd file that `PodTargets` rewrites from the live pod
list, with the `namespace` and `pod` labels kubernetes_sd would give them.

Each pod's hit rate follows a profile chosen per namespace and track: stable pods are warm
(0.6 from their first scrape); canary pods either refill their cache (0 -> 0.6 over
`ramp_s`) or never recover (0.05: a cache-key field changed).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

LOOKUP_TOKENS_PER_S = 1000.0
WARM_HIT_RATE = 0.6
BROKEN_HIT_RATE = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Pod:
    first_seen: float
    profile: str  # "warm" | "ramp" | "broken"


@dataclass
class Profiles:
    ramp_s: float = 6.0
    canary: dict[str, str] = field(default_factory=dict)  # namespace -> "ramp" | "broken"
    pods: dict[tuple[str, str], _Pod] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def counters(self, namespace: str, pod: str, now: float) -> tuple[float, float]:
        with self.lock:
            state = self.pods.get((namespace, pod))
            if state is None:
                canary = "-canary-" in pod
                profile = self.canary.get(namespace, "ramp") if canary else "warm"
                state = self.pods[(namespace, pod)] = _Pod(now, profile)
        t = now - state.first_seen
        lookups = LOOKUP_TOKENS_PER_S * t
        if state.profile == "warm":
            matched = WARM_HIT_RATE * lookups
        elif state.profile == "broken":
            matched = BROKEN_HIT_RATE * lookups
        else:  # hit rate rises linearly to WARM over ramp_s: matched is its integral
            ramp = self.ramp_s
            rate = LOOKUP_TOKENS_PER_S * WARM_HIT_RATE
            matched = rate * t * t / (2 * ramp) if t < ramp else rate * (ramp / 2 + t - ramp)
        return lookups, matched


class _PodCollector(Collector):
    def __init__(self, profiles: Profiles, namespace: str, pod: str) -> None:
        self.profiles, self.namespace, self.pod = profiles, namespace, pod

    def collect(self) -> Iterator[Metric]:
        lookups, matched = self.profiles.counters(self.namespace, self.pod, time.monotonic())
        for name, value in (("lookup_tokens", lookups), ("matched_tokens", matched)):
            family = CounterMetricFamily(f"kvfleet_cache_{name}", name, labels=["tenant"])
            family.add_metric(["acme"], value)
            yield family


class CacheMetricsServer:
    """GET /metrics/<namespace>/<pod> -> that pod's cache counters (Prometheus text format)."""

    def __init__(self, profiles: Profiles) -> None:
        self.profiles = profiles
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "metrics":
                    self.send_error(404)
                    return
                registry = CollectorRegistry()
                registry.register(_PodCollector(outer.profiles, parts[1], parts[2]))
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping the file_sd targets every second."""

    def __init__(self, work_dir: Path) -> None:
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        self.targets = work_dir / "targets.json"
        self.targets.write_text("[]", encoding="utf-8")
        config = work_dir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {
                            "job_name": "replicas",
                            "scrape_interval": "1s",
                            "file_sd_configs": [
                                {"files": [str(self.targets)], "refresh_interval": "1s"}
                            ],
                        }
                    ],
                }
            ),
            encoding="utf-8",
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (work_dir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={work_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start; see {self.log.name}")
            time.sleep(0.2)

    def write_targets(self, metrics_port: int, pods: list[tuple[str, str]]) -> None:
        groups = [
            {
                "targets": [f"127.0.0.1:{metrics_port}"],
                "labels": {
                    "__metrics_path__": f"/metrics/{ns}/{pod}",
                    "namespace": ns,
                    "pod": pod,
                },
            }
            for ns, pod in sorted(pods)
        ]
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups), encoding="utf-8")
        tmp.replace(self.targets)

    def query(self, promql: str) -> list[dict[str, object]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as r:
            result: list[dict[str, object]] = json.loads(r.read())["data"]["result"]
        return result

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
