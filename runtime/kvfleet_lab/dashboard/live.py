"""A fleet on loopback that a real Prometheus scrapes, so the dashboard's queries can be run.

`kvfleet_lab.demo`'s local fleet (3 `kvfleet replica` processes and `kvfleet router`, T2 between
replicas through the peer probe, T3 files on) with the replicas' metrics token set, and Debian's
`prometheus` scraping every replica with that token and the router, each series labelled as the
chart's ServiceMonitor labels it on Kubernetes (`namespace`, `pod`). One replica's pod is named
as a ModelRollout's canary pods are (`<deployment>-canary-...`), so the rollout panel has both
sides. Traffic: the demo's mixed workload through the router, homes small enough to fill (so
requests spill, replicas fetch over T2, blocks are evicted into T3 and read back).

    with LiveDashboard(work_dir) as live:
        live.drive()
        live.query('sum(rate(kvfleet_t2_fetched_bytes_total[1m]))')
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvfleet_lab.dashboard.panels import PANELS, render_expr
from kvfleet_lab.demo import (
    FleetOptions,
    LocalFleet,
    WorkloadSpec,
    builtin_workload,
    drive,
    ensure_model,
)
from kvfleet_lab.processes import free_port

__all__ = ["NAMESPACE", "POD_NAMES", "LiveDashboard", "panel_results"]

NAMESPACE = "kvfleet-live"
DEPLOYMENT = "kvfleet-replica"
POD_NAMES = {
    "r0": f"{DEPLOYMENT}-6d9f7b5c4-abcde",
    "r1": f"{DEPLOYMENT}-6d9f7b5c4-fghij",
    "r2": f"{DEPLOYMENT}-canary-7c8d9e6f5-klmno",
    "router": "kvfleet-router-5b6c7d8e9-pqrst",
}
"""Pod names as Kubernetes gives them: the operator's gate selects the canary's by name."""
SCRAPE_INTERVAL_S = 1.0


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data: bytes = response.read()
    return data


@dataclass
class LiveDashboard:
    work_dir: Path
    model_dir: Path | None = None
    num_kv_blocks: int = 64
    num_t1_blocks: int = 96
    nvme_capacity_bytes: int = 64 << 20
    metrics_token: str = field(default_factory=lambda: secrets.token_hex(16))
    fleet: LocalFleet | None = None
    prometheus: subprocess.Popen[bytes] | None = None
    prometheus_url: str = ""
    driven: tuple[float, float] | None = None
    """Wall-clock start and end of the traffic `drive` sent (first call to last)."""

    def __enter__(self) -> LiveDashboard:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        if not Path(binary).is_file():
            raise RuntimeError("prometheus not found: `make system-deps` installs Debian's")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "logs").mkdir(exist_ok=True)
        model = self.model_dir or ensure_model(self.work_dir / "models", "tiny", 0,
                                               self.work_dir / "logs" / "model.log")
        workload = self._workload()
        self.fleet = LocalFleet(FleetOptions(
            model_dir=model, work_dir=self.work_dir, tenants=workload.tenants,
            num_kv_blocks=self.num_kv_blocks, num_t1_blocks=self.num_t1_blocks,
            metrics_token=self.metrics_token, nvme_capacity_bytes=self.nvme_capacity_bytes))
        self.fleet.start(cache_enabled=True)
        self._start_prometheus(binary)

    def _workload(self) -> Any:
        return builtin_workload("mixed", WorkloadSpec(num_requests=60, num_tenants=3, scale=0.2))

    def _start_prometheus(self, binary: str) -> None:
        assert self.fleet is not None

        def target(name: str, url: str) -> dict[str, Any]:
            return {"targets": [urllib.parse.urlsplit(url).netloc],
                    "labels": {"namespace": NAMESPACE, "pod": POD_NAMES[name]}}

        replicas = [target(n, u) for n, u in self.fleet.replica_urls.items()]
        (self.work_dir / "replicas.json").write_text(json.dumps(replicas))
        (self.work_dir / "router.json").write_text(
            json.dumps([target("router", self.fleet.router_url)]))
        common = {"scrape_interval": f"{SCRAPE_INTERVAL_S:g}s",
                  "scrape_timeout": f"{SCRAPE_INTERVAL_S:g}s"}
        config = {"global": common, "scrape_configs": [
            # As the chart's ServiceMonitor scrapes: the replicas with the metrics token.
            {"job_name": "replicas", **common,
             "authorization": {"type": "Bearer", "credentials": self.metrics_token},
             "file_sd_configs": [{"files": [str(self.work_dir / "replicas.json")]}]},
            {"job_name": "router", **common,
             "file_sd_configs": [{"files": [str(self.work_dir / "router.json")]}]},
        ]}
        (self.work_dir / "prometheus.yml").write_text(json.dumps(config))
        port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{port}"
        log = (self.work_dir / "logs" / "prometheus.log").open("wb")
        self.prometheus = subprocess.Popen(
            [binary, f"--config.file={self.work_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.work_dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(f"{self.prometheus_url}/-/ready", 1):
                    break
            except OSError:
                pass
            if self.prometheus.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start; see {log.name}")
            time.sleep(0.2)
        # Every target scraped once before traffic starts: a rate needs a sample from before.
        while True:
            targets = json.loads(_get(f"{self.prometheus_url}/api/v1/targets"))
            active = targets["data"]["activeTargets"]
            if len(active) == len(POD_NAMES) and all(t["health"] == "up" for t in active):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus did not scrape every target: " + json.dumps(
                    [(t["labels"].get("pod"), t["health"], t["lastError"]) for t in active]))
            time.sleep(0.5)

    def drive(self, rounds: int = 2, concurrency: int = 6) -> int:
        """The workload through the router `rounds` times; how many requests answered 200."""
        assert self.fleet is not None
        workload = self._workload()
        ok = 0
        start = time.time() if self.driven is None else self.driven[0]
        for _ in range(rounds):
            results = asyncio.run(drive(workload, self.fleet.router_url, self.fleet.api_keys,
                                        concurrency=concurrency))
            ok += sum(1 for r in results if r.ok)
        # Every series' last samples in: two scrapes after the last request.
        time.sleep(3 * SCRAPE_INTERVAL_S)
        self.driven = (start, time.time())
        return ok

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(_get(url))
        if body.get("status") != "success":
            raise RuntimeError(f"{promql}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def query_range(self, promql: str, start_s: float, end_s: float,
                    step_s: float = 2.0) -> list[dict[str, Any]]:
        url = f"{self.prometheus_url}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": promql, "start": start_s, "end": end_s, "step": step_s})
        body = json.loads(_get(url))
        if body.get("status") != "success":
            raise RuntimeError(f"{promql}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def close(self) -> None:
        if self.prometheus is not None and self.prometheus.poll() is None:
            self.prometheus.terminate()
            try:
                self.prometheus.wait(10)
            except subprocess.TimeoutExpired:
                self.prometheus.kill()
                self.prometheus.wait(10)
        if self.fleet is not None:
            self.fleet.stop()


def panel_results(live: LiveDashboard, rate_interval: str = "1m", step_s: float = 2.0
                  ) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every panel's every query, as Grafana would send it (variables at their defaults, the
    namespace the live fleet's), over the time range the traffic ran (a range query, as a
    dashboard's time series panel asks): (panel title, legend) -> result, each series with its
    `values`. Asked at one instant after a slow run instead, a 1-minute rate can be empty for a
    tier or a pod that was busy only in the run's first minutes."""
    if live.driven is None:
        raise RuntimeError("no traffic yet: call drive() first")
    start_s, end_s = live.driven
    out = {}
    for panel in PANELS:
        for target in panel.targets:
            expr = render_expr(target.expr, {"namespace": NAMESPACE}, rate_interval)
            out[(panel.title, target.legend)] = live.query_range(expr, start_s, end_s, step_s)
    return out
