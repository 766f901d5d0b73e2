"""The operator's rollout gate on serving vLLMs: a real Prometheus (Debian's) scrapes three `vllm
serve` processes with kvfleet's connector, `kvfleet_operator.metrics.read_hit_rates` runs its
default vLLM query (vLLM's prefix-cache hits plus the connector's matched tokens, over vLLM's
prefix-cache queries) and the rollout planner (`kvfleet_operator.planning.advance`, on the
simulated Deployments of tests/operator/world.py) decides: a canary configured as the stable
version recovers its hit rate and the rollout promotes; a canary whose connector admits nothing
(`kvfleet.admit_min_sightings` out of reach) cannot hit, and the rollout rolls back.

vLLM's own KV (T0) is 32 blocks here and the workload cycles through six 1,000-token prompts
(47 blocks): under vLLM's LRU every prompt has left T0 before it comes back, so each hit is the
host pool's and the two canaries differ only by their connector."""

from __future__ import annotations

import json
import random
import shutil
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvfleet_operator.api import MetricsSpec, RolloutPhase
from kvfleet_operator.metrics import DeploymentPods, read_hit_rates
from tests.operator.replicas import Prometheus
from tests.operator.world import World, rollout_spec

from .conftest import MODEL, VllmServe, connector_config, start_all, stop_all

NAMESPACE = "llm"
SMALL_T0_BYTES = 4 << 20
"""32 vLLM blocks of 128 tokens (1 KiB of KV per token): less than the workload's 47."""
NEVER = 1_000_000
PROMPTS = [[random.Random(seed).randrange(3, 500) for _ in range(1000)] for seed in range(6)]


@dataclass
class Gate:
    stable: VllmServe
    good: VllmServe
    """The canary of a version whose cache keys did not change: configured as `stable`."""
    bad: VllmServe
    """The canary whose connector admits nothing, so nothing can hit."""
    prom: Prometheus


@pytest.fixture(scope="module")
def gate(serve_model: Path, serve_dir: Path) -> Iterator[Gate]:
    if shutil.which("prometheus") is None and not Path("/usr/bin/prometheus").exists():
        pytest.skip("needs Debian's prometheus (scripts/system-deps.sh)")

    def server(name: str, **extra: int) -> VllmServe:
        return VllmServe(name, serve_model, serve_dir / f"{name}.log", args=[
            "--kv-cache-memory-bytes", str(SMALL_T0_BYTES), "--kv-transfer-config",
            connector_config(serve_dir / f"{name}.pool", **extra)])

    servers = [server("gate-stable"), server("gate-good"),
               server("gate-bad", admit_min_sightings=NEVER, hot_min_sightings=NEVER)]
    (serve_dir / "prometheus").mkdir()
    prom = Prometheus(serve_dir / "prometheus")
    try:
        start_all(servers)
        yield Gate(*servers, prom)
    finally:
        stop_all(servers)
        prom.close()


def complete(server: VllmServe, tokens: list[int]) -> None:
    server.post("/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 2,
                                    "temperature": 0})


def queries(prom: Prometheus, pod: str) -> float | None:
    got = prom.query(f'sum({{__name__=~"vllm[:_]prefix_cache_queries_total",pod="{pod}"}})')
    return float(got[0]["value"][1]) if got else None


def wait_for(prom: Prometheus, pod: str, want: float) -> None:
    """Until Prometheus has scraped `want` queries of `pod` (at least two scrapes of it)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (queries(prom, pod) or 0) >= want:
            return
        time.sleep(0.5)
    with urllib.request.urlopen(prom.url + "/api/v1/targets", timeout=5) as r:
        targets = [(t["labels"], t["health"], t["lastError"])
                   for t in json.loads(r.read())["data"]["activeTargets"]]
    raise AssertionError(f"prometheus saw {queries(prom, pod)} queries of {pod}, want {want}; "
                         f"targets: {targets}")


@pytest.fixture(scope="module")
def scraped(gate: Gate) -> Gate:
    """Each server: one cycle before Prometheus scrapes it (every prompt computed once, stored
    by the connectors that admit), a baseline scrape, then two cycles inside the rate window."""
    pods = {"llm-0": gate.stable, "llm-canary-good-0": gate.good, "llm-canary-bad-0": gate.bad}

    def cycle() -> None:  # the servers in step: each one's counters move in the same minutes
        for p in PROMPTS:
            for s in pods.values():
                complete(s, p)

    cycle()
    gate.prom.write_targets([(NAMESPACE, pod, s.port) for pod, s in pods.items()])
    baseline = {pod: 0.0 for pod in pods}
    for pod in pods:
        wait_for(gate.prom, pod, 1)
        time.sleep(2.0)  # a second scrape of the same counts: the baseline
        baseline[pod] = queries(gate.prom, pod) or 0.0
    cycle()
    cycle()
    for pod in pods:
        wait_for(gate.prom, pod, baseline[pod] + 2 * 6 * 1000)
    return gate


def rollout(gate: Gate, canary_pod: str) -> World:
    """A rollout whose every gate evaluation reads the hit rates from Prometheus."""
    spec = MetricsSpec.model_validate({"prometheus": {"url": gate.prom.url},
                                       "cacheStats": {"enabled": False}})
    target = DeploymentPods(NAMESPACE, "llm", (), ("llm-0",), engine="vllm")
    canary = DeploymentPods(NAMESPACE, "llm-canary", (), (canary_pod,), engine="vllm")
    w = World(rollout_spec(gate={"holdSeconds": 0, "windowSeconds": 600,
                                 "readyTimeoutSeconds": 600}))
    for _ in range(40):
        reading = read_hit_rates(spec, target, canary)
        assert reading.source == "prometheus"
        w.target_hit, w.canary_hit = reading.target_hit_rate, reading.canary_hit_rate
        w.step(60)
        if w.status.phase in (RolloutPhase.PROMOTING, RolloutPhase.ROLLING_BACK):
            return w
    raise AssertionError(f"the rollout is still {w.counts()} after 40 evaluations")


def test_a_canary_whose_hit_rate_recovers_is_promoted(scraped: Gate) -> None:
    w = rollout(scraped, "llm-canary-good-0")
    assert w.status.phase is RolloutPhase.PROMOTING
    # every hit is the host pool's (T0 is too small): 7 of each prompt's 8 vLLM blocks (measured
    # 0.875 once; rate()'s window edges move it by less than 0.01)
    assert w.target_hit is not None and w.target_hit == pytest.approx(7 / 8, abs=0.01)
    assert w.canary_hit is not None and w.canary_hit == pytest.approx(w.target_hit, abs=0.01)


def test_a_canary_that_cannot_hit_is_rolled_back(scraped: Gate) -> None:
    w = rollout(scraped, "llm-canary-bad-0")
    assert w.status.phase is RolloutPhase.ROLLING_BACK
    assert w.status.reason == "HitRateNotRecovered"
    assert w.canary_hit == 0.0
    assert "canary hit rate 0.000 <" in w.status.message
