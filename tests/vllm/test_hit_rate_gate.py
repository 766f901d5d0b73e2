"""The operator's rollout gate reads a vLLM replica's hit rate from a real Prometheus scraping
vLLM's own metrics: vLLM's real `Scheduler` (with the connector) produces the stats, vLLM's own
`PrometheusStatLogger` exports them (vLLM's `prefix_cache` counters and the connector's
`kvfleet_cache_*` counters, through vLLM's connector metrics hook) on a loopback HTTP endpoint,
Debian's Prometheus scrapes it every second, and `kvfleet_operator.metrics.read_hit_rates`
runs its default vLLM query. Known counter deltas give the exact expected rate. A second target
exports vLLM's two counters only (a replica whose connector has no series yet): its rate is the
T0 share, not "no data"."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not importable here: tests/vllm run in vLLM's own "
                    "environment (make test-vllm)")

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter, start_http_server
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.metrics.loggers import PrometheusStatLogger

from kvfleet_operator.api import MetricsSpec
from kvfleet_operator.metrics import DeploymentPods, read_hit_rates
from tests.operator.replicas import Prometheus
from tests.support import free_port
from tests.vllm import _support as sup

NAMESPACE, POD = "llm", "llm-vllm-0"
BYPASSED = "llm-vllm-1"
"""A replica whose connector has seen no request (all bypassed): vLLM's counters only, served
under vLLM's names by a plain prometheus_client registry."""


def _prompt(seed: int) -> list[int]:
    return [(i * 11 + seed) % 500 for i in range(100)]  # 6 full blocks and a 4-token tail


def _run(s, w, views, req) -> None:
    s.add_request(req)
    for _ in range(20):
        if not s.has_unfinished_requests():
            return
        sup.step(s, [w], [views])
    raise AssertionError("request did not finish")


def _workload(s, w, views, seed: int) -> None:
    """One miss, one host-pool hit (vLLM forgot the prompt: the connector loads 96 tokens),
    one vLLM prefix hit (112 tokens, the connector adds nothing)."""
    prompt = _prompt(seed)
    _run(s, w, views, sup.request(f"a{seed}", prompt))
    assert s.kv_cache_manager.reset_prefix_cache()
    _run(s, w, views, sup.request(f"b{seed}", prompt[:96] + [11] * 20))
    _run(s, w, views, sup.request(f"c{seed}", prompt[:96] + [11] * 20))


def _wait(prom: Prometheus, query: str, want: float, what: str, *, at_least: bool = False
          ) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = prom.query(query)
        value = float(result[0]["value"][1]) if result else None
        if value is not None and (value >= want if at_least else value == want):
            return
        time.sleep(0.25)
    with urllib.request.urlopen(prom.url + "/api/v1/targets", timeout=5) as r:
        targets = [(t["health"], t["lastError"]) for t in
                   json.loads(r.read())["data"]["activeTargets"]]
    with urllib.request.urlopen(prom.url + "/api/v1/label/__name__/values", timeout=5) as r:
        names = [n for n in json.loads(r.read())["data"] if "cache" in n]
    raise AssertionError(f"prometheus did not see {what}: {query} = {prom.query(query)}; "
                         f"targets (health, last error): {targets}; cache series: {names}")


@pytest.mark.skipif(shutil.which("prometheus") is None and not Path("/usr/bin/prometheus").exists(),
                    reason="needs Debian's prometheus (scripts/system-deps.sh)")
def test_the_gate_reads_vllm_t0_plus_kvfleet_hits_over_vllm_queries(tiny_checkpoint, tmp_path):
    vc = sup.vllm_config(tiny_checkpoint, tmp_path / "pool")
    s = sup.scheduler(vc, num_blocks=64)
    w = sup.worker(vc)
    views = sup.layer_views(64, 4, 16, 16, KVCacheLayout.LBNHC)
    torch.manual_seed(3)
    for v in views:
        v.copy_(torch.randn(v.shape, dtype=torch.float16))
    w.register_kv_caches(dict(zip(sup.LAYERS, views, strict=True)))

    logger = PrometheusStatLogger(vc, engine_indexes=[0])  # vLLM's frontend metrics, REGISTRY
    shipped = []
    update = s.update_from_output

    def update_and_log(*args, **kwargs):  # what vLLM's frontend does with each step's stats
        outputs = update(*args, **kwargs)
        for eco in outputs.values():
            if eco.scheduler_stats is not None:
                shipped.append(eco.scheduler_stats)
                logger.record(scheduler_stats=eco.scheduler_stats, iteration_stats=None,
                              engine_idx=0)
        return outputs

    s.update_from_output = update_and_log
    labels = {"model_name": vc.model_config.served_model_name, "engine": "0", "tenant": "tenant-a"}

    _run(s, w, views, sup.request("first", _prompt(0)))
    # the tenant's first report creates all its series, at 0 for what it has not done yet
    assert REGISTRY.get_sample_value("kvfleet_cache_matched_tokens_total", labels) == 0
    _workload(s, w, views, 1)  # the baseline every series has when Prometheus first scrapes
    queries0 = REGISTRY.get_sample_value("vllm:prefix_cache_queries_total",
                                         {k: labels[k] for k in ("model_name", "engine")})
    assert queries0 == 100 + 332

    port = free_port()
    start_http_server(port, addr="127.0.0.1")
    bypassed = CollectorRegistry()
    engine_labels = (vc.model_config.served_model_name, "0")
    t0_queries, t0_hits = (
        Counter(f"vllm:prefix_cache_{n}", n, ["model_name", "engine"], registry=bypassed)
        .labels(*engine_labels) for n in ("queries", "hits"))
    t0_queries.inc(1000)
    t0_hits.inc(100)
    bypassed_port = free_port()
    start_http_server(bypassed_port, addr="127.0.0.1", registry=bypassed)
    (tmp_path / "prometheus").mkdir()
    prom = Prometheus(tmp_path / "prometheus")
    try:
        prom.write_targets([(NAMESPACE, POD, port), (NAMESPACE, BYPASSED, bypassed_port)])
        pod = f'namespace="{NAMESPACE}",pod="{POD}"'
        # vLLM's `vllm:` names arrive as `vllm_` from prometheus_client's OpenMetrics output
        queries = f'{{__name__=~"vllm[:_]prefix_cache_queries_total",{pod}}}'
        other = f'{{__name__=~"vllm[:_]prefix_cache_queries_total",pod="{BYPASSED}"}}'
        for series in (queries, other):
            _wait(prom, f"count_over_time({series}[1m])", 3, "three scrapes of the baseline",
                  at_least=True)
        mark = len(shipped)
        _workload(s, w, views, 2)
        t0_queries.inc(400)
        t0_hits.inc(100)
        delta = {"queries": sum(st.prefix_cache_stats.queries for st in shipped[mark:]),
                 "hits": sum(st.prefix_cache_stats.hits for st in shipped[mark:]),
                 "matched": sum(st.kv_connector_stats["tenants"]["tenant-a"].get(
                     "matched_tokens", 0) for st in shipped[mark:] if st.kv_connector_stats)}
        assert delta == {"queries": 100 + 116 + 116, "hits": 112, "matched": 96}
        _wait(prom, queries, queries0 + 332, "the workload's queries")
        _wait(prom, f"kvfleet_cache_matched_tokens_total{{{pod}}}", 96 * 2, "its matches")
        _wait(prom, other, 1400, "the bypassed replica's queries")

        spec = MetricsSpec.model_validate({"prometheus": {"url": prom.url},
                                           "cacheStats": {"enabled": False}})
        pods = DeploymentPods(NAMESPACE, "llm", (), (POD,), engine="vllm")
        reading = read_hit_rates(spec, pods, None)
        assert reading.source == "prometheus"
        # every series has the same scrape timestamps and a baseline, so rate()'s
        # extrapolation is the same factor for all three: the ratio is the deltas' ratio
        assert reading.target_hit_rate == pytest.approx((112 + 96) / 332, rel=1e-9)
        assert reading.target_saved_prefill_tokens_per_s is not None
        assert reading.target_saved_prefill_tokens_per_s > 0
        # kvfleet's own default query sees only the connector's share of the same replica
        kvfleet = read_hit_rates(spec, DeploymentPods(NAMESPACE, "llm", (), (POD,)), None)
        assert kvfleet.target_hit_rate == pytest.approx(96 / 332, rel=1e-9)
        # no connector series at all: the T0 share, not "no data" (the `or vector(0)`)
        t0_only = read_hit_rates(
            spec, DeploymentPods(NAMESPACE, "llm", (), (BYPASSED,), engine="vllm"), None)
        assert t0_only.target_hit_rate == pytest.approx(100 / 400, rel=1e-9)
    finally:
        prom.close()
