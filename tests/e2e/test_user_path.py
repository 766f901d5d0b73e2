"""The user's whole path, end to end (issue 8, point 3), with the real helm and kubectl binaries:

  helm install -> kubectl apply -f examples/kvcachepolicy.yaml -> traffic from the shared trace
  through the router -> kubectl apply -f examples/modelrollout.yaml (short windows) ->
  A: promoted step by step (C: with the operator SIGKILLed and restarted mid-rollout) ->
  B: a new image whose cache key never holds still is rolled back when its gate times out ->
  helm upgrade -> helm uninstall leaves only the CRDs.

Scenario B needs a canary whose hit rate never recovers. A real, stable key change (another
attention implementation id, tried first) is not that: the canary starts as cold as one with new
weights and, under the test's traffic, warms within seconds, so it passed its gate. What the
design means by "did not recover" is a key component that keeps changing, which the real replica
cannot be made to do; so it is the one fault the harness injects: pods of the image
kubelet.UNSTABLE_KEY_IMAGE run the real replica through unstable_key.py, which adds a per-request
nonce to attn_impl_id and then runs the unchanged `kvfleet` entry point. The ModelRollout only
names that image (spec.image); the operator, router, Prometheus and Redis are the real ones.

What runs is described in conftest.py: kwok pods on loopback fake GPU nodes, backed by real
replica and router processes; the operator, Redis and Prometheus as real processes. The tests run
in file order and share one release (each step is the state the next one starts from).
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import pytest
import yaml

from kvfleet_lab.dashboard.panels import PANELS, render_expr
from tests.cluster.fixtures import CommandError
from tests.e2e.conftest import MODEL_ID, RELEASE, REPLICA_LABEL, ROOT, World, dump
from tests.e2e.kubelet import UNSTABLE_KEY_IMAGE, http_json
from tests.e2e.traffic import NUM_TENANTS, Traffic, load_requests, tenant_name
from tests.e2e.unstable_key import MARKER
from tests.e2e.world import elapsed, events, kubectl_table, wait_for

E2E_PANELS = frozenset({"Fleet token hit rate", "Hit rate per tenant", "Prefill tokens saved",
                        "TTFT p50 / p99, hit vs miss"})
"""The dashboard's panels over series this fleet's replicas publish under its traffic."""

pytestmark = [pytest.mark.e2e, pytest.mark.k8s, pytest.mark.slow]

ROUTER_LABEL = "app.kubernetes.io/component=router"
def hit_rate_query(rate_window: str) -> str:
    """The operator's default gate query (matched / looked-up prompt tokens) over `rate_window`."""
    selector = '{namespace="${namespace}",pod=~"${pod_regex}"}'
    return (
        f"sum(rate(kvfleet_cache_matched_tokens_total{selector}[{rate_window}])) / "
        f"sum(rate(kvfleet_cache_lookup_tokens_total{selector}[{rate_window}]))"
    )


# The gate's hit rate over the last 10 s (the default is 1 min: too slow for a test).
HIT_RATE_QUERY = hit_rate_query("10s")
_state: dict[str, Any] = {}  # what one step hands the next (the traffic generator)


def _gate_query(namespace: str, deployment: str) -> str:
    """HIT_RATE_QUERY over every pod `deployment` has had (the operator narrows it to the pods
    that exist now: kvfleet_operator.metrics.render_query)."""
    return HIT_RATE_QUERY.replace("${namespace}", namespace).replace(
        "${pod_regex}", f"{deployment}-[a-z0-9]+-[a-z0-9]+")


def _replica_processes(world: World, digest: str | None = None) -> list[Any]:
    pods = world.shim.running(REPLICA_LABEL)
    if digest is None:
        return pods
    return [p for p in pods if _serving_digest(p) == digest]


def _serving_digest(pod: Any) -> str | None:
    status, body = http_json(f"{pod.url}/readyz", timeout_s=3)
    return body.get("weights_digest") if status == 200 and isinstance(body, dict) else None


def _router_url(world: World) -> str:
    (router,) = world.shim.running(ROUTER_LABEL)
    return router.url


def _mro_status(world: World, name: str) -> dict[str, Any]:
    out = json.loads(world.kubectl("get", "-n", world.namespace, "mro", name, "-o", "json"))
    status: dict[str, Any] = out.get("status") or {}
    return status


def _deployment(world: World, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(
        world.kubectl("get", "-n", world.namespace, "deployment", name, "-o", "json"))
    return out


def _template_digest(deployment: dict[str, Any]) -> str:
    annotations = deployment["spec"]["template"]["metadata"].get("annotations") or {}
    return str(annotations.get("kvfleet.dev/weights-digest"))


def _diagnostics(world: World) -> str:
    return world.diagnostics(_state.get("traffic"))


def _rollout_manifest(name: str, digest: str, prometheus_url: str, window_s: int,
                      hold_s: int = 5, image: str | None = None) -> str:
    """examples/modelrollout.yaml as the user edits it for this release: the chart's Deployment,
    the new digest (and image, if any), our Prometheus, short windows."""
    doc = yaml.safe_load((ROOT / "examples" / "modelrollout.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["targetRef"]["name"] = f"{RELEASE}-replica"
    doc["spec"]["weightsDigest"] = digest
    if image is not None:
        doc["spec"]["image"] = image
    doc["spec"]["gate"].update(
        windowSeconds=window_s, holdSeconds=hold_s, readyTimeoutSeconds=90,
        checkIntervalSeconds=1)
    doc["spec"]["surge"] = {"mode": "None"}  # two shared CPU cores: no extra canary processes
    doc["spec"]["metrics"]["prometheus"] = {"url": prometheus_url, "hitRateQuery": HIT_RATE_QUERY}
    return yaml.safe_dump(doc)


class RolloutWatch:
    """What `kubectl get modelrollouts NAME -o wide -w` shows a user: the table row each time the
    phase, step or reason changes, polled every second in the background."""

    def __init__(self, world: World, name: str) -> None:
        self.world, self.name = world, name
        self.header = ""
        self.rows: list[str] = []
        self._last: tuple[str, ...] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._row()
            self._stop.wait(1.0)

    def _row(self) -> None:
        try:
            table = kubectl_table(self.world.cluster, self.world.namespace,
                                  "modelrollouts", self.name, "-o", "wide").splitlines()
        except CommandError:
            return
        if len(table) == 2:
            self.header = table[0]
            cells = table[1].split()
            key = tuple(cells[2:5] + cells[-2:-1])  # phase, step, steps, reason
            if key != self._last:
                self.rows.append(table[1])
                self._last = key

    def table(self) -> str:
        return "\n".join([self.header, *self.rows])

    def wait_phase(self, phases: set[str], timeout_s: float) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            status = _mro_status(self.world, self.name)
            return status if status.get("phase") in phases else None

        status: dict[str, Any] = wait_for(
            reached, f"ModelRollout {self.name} reaches {sorted(phases)}", timeout_s,
            lambda: self.table() + "\n" + _diagnostics(self.world))
        return status

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(10)
        self._row()  # the final state
        return self.table()


# ---------------------------------------------------------------------------------------------


def test_1_helm_install_policy_and_warm_caches(world: World) -> None:
    started = time.monotonic()
    ns = world.namespace
    out = world.cluster.helm("install", RELEASE, str(ROOT / "charts" / "kvfleet"), "-n", ns,
                             "-f", str(world.values_file), "--wait=false", timeout_s=180).stdout
    assert "STATUS: deployed" in out, out
    world.operator_identity = world.cluster.mint_identity(ns, f"{RELEASE}-operator")
    assert world.operator_identity.kubectl(
        "auth", "can-i", "patch", "modelrollouts.kvfleet.dev/status", "-A").stdout.strip() == "yes"
    assert world.operator_identity.kubectl(
        "auth", "can-i", "get", "secrets", "-A", check=False).stdout.strip() == "no"
    world.start_operator("operator-1", priority=100)

    # The replica pods land on the loopback GPU nodes; the shim starts one real replica each.
    replicas = wait_for(lambda: len(_replica_processes(world)) == 2 and _replica_processes(world),
                        "2 replica processes started for the replica pods", 60,
                        lambda: _diagnostics(world))
    for pod in replicas:
        assert pod.ip.startswith("127.77."), pod.ip
    # kwok marks pods Ready without probing: readiness is the real process' /readyz.
    wait_for(lambda: all(_serving_digest(p) == world.digests["v1"] for p in replicas),
             "both replicas' /readyz report the installed digest", 120,
             lambda: "\n".join(p.process.log_tail(15) for p in replicas))

    # The user's policy: the example, applied as is, then pointed at this release's pods.
    world.kubectl("apply", "-n", ns, "-f", str(ROOT / "examples" / "kvcachepolicy.yaml"))
    patch = {"spec": {
        "selector": {"matchLabels": {"app": None, "app.kubernetes.io/name": "kvfleet-replica",
                                     "app.kubernetes.io/instance": RELEASE}},
        "replicaPort": world.replica_port,
        "tenants": [tenant_name(i) for i in range(NUM_TENANTS)],
        "affinity": {"k": 1},
    }}
    world.kubectl("patch", "-n", ns, "kvcachepolicy", "chat", "--type=merge", "-p",
                  json.dumps(patch))

    def published() -> dict[str, Any] | None:
        cm = json.loads(world.kubectl("get", "-n", ns, "configmap", "chat-fleet", "-o", "json"))
        fleet = yaml.safe_load(cm["data"]["fleet.yaml"])
        urls = sorted(r["url"] for r in fleet["replicas"])
        return fleet if urls == sorted(p.url for p in replicas) else None

    fleet = wait_for(published, "ConfigMap chat-fleet lists the 2 replica processes' URLs", 60,
                     lambda: _diagnostics(world))
    # No home sets in it: every reader ranks them from the replica list (the operator's status
    # counts them: the TENANTS column below).
    assert not fleet.get("home_sets"), fleet.get("home_sets")
    table = kubectl_table(world.cluster, ns, "kvcachepolicies")
    print(f"\n$ kubectl get kvcachepolicies\n{table}")
    assert table.splitlines()[1].split()[:5] == ["chat", "device,host,peer", "2",
                                                str(NUM_TENANTS), "True"]

    router = wait_for(lambda: world.shim.running(ROUTER_LABEL), "the router process", 60,
                      lambda: _diagnostics(world))[0]
    wait_for(lambda: http_json(f"{router.url}/readyz")[0] == 200,
             "router /readyz (it reads the fleet config the operator published)", 60,
             lambda: router.process.log_tail(20))

    traffic = Traffic(router.url, load_requests(), MODEL_ID)
    first = traffic.send(traffic.requests[0])
    assert first.status == 200, first
    traffic.start()
    _state["traffic"] = traffic
    wait_for(lambda: traffic.hit_rate(10) > 0.8, "the trace's prefixes hit the warm caches", 90,
             lambda: traffic.summary(10) + "\n" + _diagnostics(world))
    # Prometheus scrapes the real replicas and sees the same.
    query = ('sum(rate(kvfleet_cache_matched_tokens_total[10s])) / '
             'sum(rate(kvfleet_cache_lookup_tokens_total[10s]))')
    wait_for(lambda: float(world.prometheus.query(query)[0]["value"][1]) > 0.7,
             "Prometheus' hit rate of the replicas > 0.7", 60, lambda: _diagnostics(world))
    # The chart's dashboard shows this fleet: its replica panels have data in this Prometheus
    # (labelled as the chart's ServiceMonitor labels; the router is not scraped here, and
    # tests/lab/dashboard runs every panel against a fleet with T2, T3 and spill).
    for panel in PANELS:
        if panel.title not in E2E_PANELS:
            continue
        for target in panel.targets:
            expr = render_expr(target.expr, {"namespace": ns}, "30s")

            def has_data(expr: str = expr) -> bool:
                return any(math.isfinite(float(s["value"][1]))
                           for s in world.prometheus.query(expr))

            wait_for(has_data, f"dashboard panel {panel.title!r} / {target.legend!r} has data",
                     30, lambda: _diagnostics(world))
    print(f"install + policy + warm: {elapsed(started)}; {traffic.summary(10)}")


def test_2_rollout_promoted_step_by_step_across_an_operator_kill(world: World) -> None:
    """Scenario A (new weights; the canary's cache warms within the window) with scenario C (the
    operator SIGKILLed in the middle of step 2 and restarted: the rollout resumes at that step)."""
    started = time.monotonic()
    ns, v1, v2 = world.namespace, world.digests["v1"], world.digests["v2"]
    watch = RolloutWatch(world, "v2")
    world.kubectl("apply", "-n", ns, "-f", "-",
                  stdin=_rollout_manifest("v2", v2, world.prometheus.url, window_s=150))
    wait_for(lambda: _mro_status(world, "v2").get("currentStep") == 2
             and _mro_status(world, "v2").get("stepState") == "Gating",
             "rollout v2 gating step 2", 120, lambda: _diagnostics(world))
    canaries = _replica_processes(world, v2)
    assert canaries and all(p.name.startswith(f"{RELEASE}-replica-canary-") for p in canaries)

    # C: kill the operator without warning mid-step, start a new one (higher priority: the dead
    # one's peering record outlives it for 60 s, and a lower one would wait that long).
    before = _mro_status(world, "v2")
    world.operators[-1].kill()
    time.sleep(3)
    assert _mro_status(world, "v2")["currentStep"] == 2
    world.start_operator("operator-2", priority=200)
    st = watch.wait_phase({"Succeeded", "RolledBack", "Failed"}, 240)
    print("\n$ kubectl get modelrollouts v2 -o wide -w   (rows as they changed)\n" + watch.stop())
    assert st["phase"] == "Succeeded", dump(st)
    started_steps = [h["step"] for h in st["history"] if h["reason"] == "StepStarted"]
    # Resumed at step 2: no step skipped, none repeated.
    assert started_steps == [1, 2, 3, 4], st["history"]
    assert before["steps"][1]["startedAt"] == st["steps"][1]["startedAt"]
    assert [s["result"] for s in st["steps"]] == ["Passed"] * 4
    for step in st["steps"]:
        assert step["observedHitRate"] >= step["targetHitRate"] > 0.5, step
    assert st["metricSource"] == "prometheus"
    wanted = {"StepStarted", "CanaryReady", "StepPassed", "Promoting", "TargetReady",
              "Succeeded"}
    # Events are posted after the status write they describe: give the last one a moment.
    wait_for(lambda: wanted <= {e["reason"] for e in events(world.cluster, ns, "ModelRollout",
                                                              "v2")},
             "the rollout's events", 60, lambda: _diagnostics(world))
    reasons = [e["reason"] for e in events(world.cluster, ns, "ModelRollout", "v2")]
    print("events: " + " ".join(reasons))
    target = _deployment(world, f"{RELEASE}-replica")
    assert _template_digest(target) == v2 and target["spec"]["replicas"] == 2
    # The real processes follow: the chart's Deployment now serves v2, the canary is gone.
    wait_for(lambda: len(_replica_processes(world)) == 2
             and all(_serving_digest(p) == v2 for p in _replica_processes(world)),
             "exactly the 2 replica processes of the chart's Deployment serve v2", 90,
             lambda: _diagnostics(world))
    assert not [p for p in world.shim.running(REPLICA_LABEL) if _serving_digest(p) == v1]
    assert world.shim.running("kvfleet.dev/track=canary") == []
    traffic: Traffic = _state["traffic"]
    print(f"scenario A+C: {elapsed(started)}; traffic during it: "
          f"{traffic.summary(time.monotonic() - started)}")


def test_3_a_cache_key_that_never_recovers_is_rolled_back(world: World) -> None:
    """Scenario B: a new runtime image (same weights, v2) that unintentionally changed a cache-key
    component, one that keeps changing: none of its requests can ever match a cached prefix, so
    its canary's hit rate stays at zero, the step's window (short here) closes unrecovered and the
    operator rolls back to v2 on its own. The image is the harness' one fault
    (kubelet.UNSTABLE_KEY_IMAGE, unstable_key.py): the real replica with attn_impl_id nonced per
    request; the operator, router, Prometheus and Redis are as in every other step."""
    started = time.monotonic()
    ns, v2 = world.namespace, world.digests["v2"]
    target_name = f"{RELEASE}-replica"
    before = _deployment(world, target_name)  # what scenario A left: v2 on 2 replicas
    assert _template_digest(before) == v2 and before["spec"]["replicas"] == 2
    (stable_image,) = [c["image"] for c in before["spec"]["template"]["spec"]["containers"]]
    assert stable_image != UNSTABLE_KEY_IMAGE
    traffic: Traffic = _state["traffic"]
    # Start from a settled fleet: the stable pods (re-created by A's handoff) warm again, which
    # is the gate's baseline. A's canary stopped seconds ago and its last samples are still in the
    # rate window, under the same Deployment name as v3's canary: the operator must measure only
    # the canary pods that exist now (metrics.pod_regex), so the test does not wait them out.
    stable_query = _gate_query(ns, target_name)
    canary_query = _gate_query(ns, f"{target_name}-canary")
    wait_for(lambda: float(world.prometheus.query(stable_query)[0]["value"][1]) > 0.8,
             "the stable replicas' hit rate (the gate's query) > 0.8", 90,
             lambda: _diagnostics(world))
    print(f"A's canary series still in the rate window at the apply: "
          f"{world.prometheus.query(canary_query)}")
    applied = time.monotonic()
    watch = RolloutWatch(world, "v3")
    # The window opens at CanaryReady, which kwok's own Ready can advance by a shim poll
    # (kubelet.py); the canary needs ~15 s to load on two shared cores: 50 s leave it >= 20 s of
    # measured traffic.
    world.kubectl("apply", "-n", ns, "-f", "-",
                  stdin=_rollout_manifest("v3", v2, world.prometheus.url, window_s=50,
                                          image=UNSTABLE_KEY_IMAGE))
    canary = wait_for(
        lambda: [p for p in world.shim.running("kvfleet.dev/track=canary")
                 if p.image == UNSTABLE_KEY_IMAGE and _serving_digest(p) == v2],
        "the v3 canary serving (the unstable-key image)", 90, lambda: _diagnostics(world))[0]
    assert canary.name.startswith(f"{target_name}-canary-"), canary.name
    assert MARKER in canary.process.log_path.read_text(errors="replace")  # the fault is in

    st = watch.wait_phase({"RolledBack", "Succeeded", "Failed"}, 150)
    print("\n$ kubectl get modelrollouts v3 -o wide -w   (rows as they changed)\n" + watch.stop())
    assert st["phase"] == "RolledBack", dump(st)
    assert st["reason"] == "HitRateNotRecovered", dump(st)
    assert "a cache-key field probably changed" in st["message"], st["message"]
    (step,) = st["steps"]  # never got past the first step
    assert step["result"] == "TimedOut", step
    # The canary served traffic and was measured: its cache never matched, the stable's did.
    assert step["targetHitRate"] > 0.5, step
    assert step["observedHitRate"] is not None and step["observedHitRate"] < 0.05, step
    assert st["previous"]["weightsDigest"] == v2 and st["previous"]["replicas"] == 2, dump(st)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "HitRateNotRecovered", degraded
    wait_for(lambda: {"HitRateNotRecovered", "RolledBack"} <= {
        e["reason"] for e in events(world.cluster, ns, "ModelRollout", "v3")},
        "the rollback's events", 60, lambda: _diagnostics(world))
    evs = events(world.cluster, ns, "ModelRollout", "v3")
    reasons = [e["reason"] for e in evs]
    print("events: " + " ".join(reasons))
    why = next(e for e in evs if e["reason"] == "HitRateNotRecovered")
    print(f"event HitRateNotRecovered: {why['message']}")
    assert why["type"] == "Warning" and "a cache-key field probably changed" in why["message"]
    rolled_back = next(e for e in evs if e["reason"] == "RolledBack")
    print(f"event RolledBack: {rolled_back['message']}")
    assert reasons.index("HitRateNotRecovered") < reasons.index("RolledBack")
    assert "StepPassed" not in reasons and "Promoting" not in reasons

    target = _deployment(world, target_name)
    assert _template_digest(target) == v2 and target["spec"]["replicas"] == 2
    assert [c["image"] for c in target["spec"]["template"]["spec"]["containers"]] == [
        stable_image]
    # The real processes follow: the canary's is gone, the chart's 2 replicas serve v2.
    wait_for(lambda: world.shim.running("kvfleet.dev/track=canary") == []
             and len(_replica_processes(world)) == 2
             and all(p.image == stable_image and _serving_digest(p) == v2
                     for p in _replica_processes(world)),
             "the canary's process gone, exactly the 2 stable v2 replica processes serve", 90,
             lambda: _diagnostics(world))
    assert canary.name not in [p.name for p in world.shim.running()]
    wait_for(lambda: traffic.hit_rate(8) > 0.8, "traffic hits the v2 caches again", 60,
             lambda: traffic.summary(8))
    # Users never saw the bad version fail: every request through the router, from the apply
    # to the restored fleet, succeeded.
    during = traffic.recent(time.monotonic() - applied)
    failed = [s for s in during if s.status != 200]
    summary = traffic.summary(time.monotonic() - applied)
    assert len(during) > 50 and not failed, summary + "\n" + world.error_lines()
    print(f"scenario B: {elapsed(started)}; traffic from the apply on: {summary}")


def test_4_helm_upgrade_and_uninstall_leave_only_the_crds(world: World) -> None:
    started = time.monotonic()
    ns, v2 = world.namespace, world.digests["v2"]
    traffic: Traffic | None = _state.pop("traffic", None)
    if traffic is not None:
        traffic.stop()
    # docs/quickstart.md step 8: after a successful rollout the values get the new digest.
    values = yaml.safe_load(world.values_file.read_text())
    values["replica"]["model"]["weightsDigest"] = v2
    world.values_file.write_text(yaml.safe_dump(values))
    out = world.cluster.helm("upgrade", RELEASE, str(ROOT / "charts" / "kvfleet"), "-n", ns,
                             "-f", str(world.values_file), timeout_s=180).stdout
    assert "REVISION: 2" in out, out
    assert _template_digest(_deployment(world, f"{RELEASE}-replica")) == v2
    wait_for(lambda: len(_replica_processes(world, v2)) == 2, "2 v2 replicas after the upgrade",
             90, lambda: _diagnostics(world))

    # docs/quickstart.md step 9.
    world.kubectl("delete", "mro", "--all", "-n", ns)
    world.kubectl("delete", "kvcp", "--all", "-n", ns)
    world.cluster.helm("uninstall", RELEASE, "-n", ns, "--wait", timeout_s=180)
    for op in world.operators:
        op.stop()
    instance = f"app.kubernetes.io/instance={RELEASE}"

    def leftovers() -> list[str]:
        names = world.kubectl(
            "get", "-n", ns, "deployments,replicasets,pods,services,configmaps,secrets,"
            "serviceaccounts,poddisruptionbudgets,networkpolicies,roles,rolebindings",
            "-o", "name").split()
        ours = [n for n in names if n not in (
            "configmap/kube-root-ca.crt", "serviceaccount/default")]
        cluster_wide = world.kubectl("get", "clusterroles,clusterrolebindings,"
                                     "clusterkopfpeerings", "-l", instance, "-o", "name").split()
        peering = world.kubectl("get", "clusterkopfpeerings", "-o", "name").split()
        return ours + cluster_wide + [p for p in peering if p.endswith("/kvfleet")]

    wait_for(lambda: not leftovers(), "nothing of the release left", 60,
             lambda: "left: " + " ".join(leftovers()))
    crds = world.kubectl("get", "crds", "-o", "name").split()
    for crd in ("kvcachepolicies.kvfleet.dev", "modelrollouts.kvfleet.dev",
                "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        assert f"customresourcedefinition.apiextensions.k8s.io/{crd}" in crds
    wait_for(lambda: world.shim.running() == [], "every pod's process stopped", 30,
             lambda: " ".join(p.name for p in world.shim.running()))
    print(f"helm upgrade + uninstall: {elapsed(started)}")
