"""`make demo-cluster`: the operator's path on this machine, narrated.

It drives the same parts the end-to-end test drives (tests/cluster: etcd, kube-apiserver,
controller-manager, scheduler and kwok started on 127.0.0.1; tests/e2e: the kubelet shim that runs
each replica and router pod of the release as a real process inside the built runtime image, and
the operator pod inside the built operator image, logged in as its ServiceAccount from the
credentials the shim projects into it; a real Redis and Prometheus), and shows what a user types
and reads:

  helm install -> kubectl apply a KVCachePolicy -> traffic through the router ->
  a ModelRollout whose canary can never hit, rolled back on the hit-rate alarm ->
  a ModelRollout of new weights, promoted -> everything stopped and removed.

The bad canary is the e2e's one injected fault: an image tag whose replica adds a per-request
nonce to a cache-key field (tests/e2e/unstable_key.py), what a key field changed by mistake looks
like. Ctrl-C (or SIGTERM) at any point stops every process and removes the cluster.

    scripts/demo-cluster.sh [--keep]     # --keep: stay up at the end until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.binaries import MissingBinariesError  # noqa: E402
from tests.cluster.cluster import Cluster, open_cluster  # noqa: E402
from tests.cluster.processes import ComponentError  # noqa: E402
from tests.e2e.conftest import CHART, MODEL_ID, RELEASE, values  # noqa: E402
from tests.e2e.kubelet import UNSTABLE_KEY_IMAGE, KubeletShim, http_json  # noqa: E402
from tests.e2e.traffic import NUM_TENANTS, Traffic, load_requests, tenant_name  # noqa: E402
from tests.e2e.world import (  # noqa: E402
    Prometheus,
    Redis,
    create_loopback_nodes,
    free_port,
    generate_model,
    wait_for,
)
from tests.images.buildah import OPERATOR, RUNTIME, have_image, working_container  # noqa: E402

NAMESPACE = "llm"
REPLICA = "app.kubernetes.io/component=replica"
ROUTER = "app.kubernetes.io/component=router"
OPERATOR_POD = "app.kubernetes.io/component=operator"
# The gate's hit rate over 10 s (the default is 1 min: too slow for a demo).
HIT_RATE_QUERY = (
    'sum(rate(kvfleet_cache_matched_tokens_total{namespace="${namespace}",pod=~"${pod_regex}"}'
    '[10s])) / sum(rate(kvfleet_cache_lookup_tokens_total{namespace="${namespace}",'
    'pod=~"${pod_regex}"}[10s]))'
)


def _print(text: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    stream.write(text + "\n")
    stream.flush()


class Narrator:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.step = 0

    def title(self, text: str) -> None:
        self.step += 1
        _print(f"\n[{time.monotonic() - self.started:4.0f}s] {self.step}. {text}")

    def say(self, text: str) -> None:
        _print(textwrap.fill(text, 100, initial_indent="   ", subsequent_indent="   "))

    def show(self, command: str, output: str) -> None:
        _print(f"\n   $ {command}")
        _print(textwrap.indent(output.rstrip(), "   "))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _rollout(name: str, digest: str, prometheus_url: str, window_s: int,
             image: str | None = None) -> str:
    """examples/modelrollout.yaml as a user edits it for this release: the chart's Deployment,
    the new digest (and image), this Prometheus, windows short enough to watch."""
    doc = yaml.safe_load((ROOT / "examples" / "modelrollout.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["targetRef"]["name"] = f"{RELEASE}-replica"
    doc["spec"]["weightsDigest"] = digest
    if image is not None:
        doc["spec"]["image"] = image
    doc["spec"]["steps"] = [{"replicas": 1}, {"percent": 100}]
    doc["spec"]["gate"].update(windowSeconds=window_s, holdSeconds=5, readyTimeoutSeconds=90,
                               checkIntervalSeconds=1)
    doc["spec"]["surge"] = {"mode": "None"}  # two cores: no extra canary processes
    doc["spec"]["metrics"]["prometheus"] = {"url": prometheus_url, "hitRateQuery": HIT_RATE_QUERY}
    return yaml.safe_dump(doc)


def _phase(cluster: Cluster, name: str) -> str:
    """The rollout's phase; "" when the API server did not answer this time (on two busy cores a
    TLS handshake can time out): the watch asks again."""
    out = cluster.kubectl("get", "-n", NAMESPACE, "mro", name, "-o", "json", check=False)
    if out.returncode != 0:
        return ""
    return str((json.loads(out.stdout).get("status") or {}).get("phase", ""))


def _events(cluster: Cluster, name: str) -> str:
    return cluster.kubectl(
        "get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp",
        "--field-selector", f"involvedObject.kind=ModelRollout,involvedObject.name={name}",
        "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message").stdout


def _watch_rollout(n: Narrator, cluster: Cluster, name: str, phases: set[str],
                   timeout_s: float, diagnostics: Callable[[], str]) -> str:
    """Print the rollout's row each time it changes (what `kubectl get mro -w` shows)."""
    last = ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        table = cluster.kubectl("get", "-n", NAMESPACE, "mro", name, "-o", "wide",
                                check=False).stdout.splitlines()
        row = table[1].rsplit(None, 1)[0] if len(table) == 2 else ""  # all but AGE
        if row and row != last:
            if not last:
                _print("   " + table[0])
            _print("   " + table[1])
            last = row
        phase = _phase(cluster, name)
        if phase in phases:
            return phase
        time.sleep(2)
    raise AssertionError(f"ModelRollout {name} did not reach {sorted(phases)} in "
                         f"{timeout_s:.0f} s\n{diagnostics()}")


def run(keep: bool) -> None:
    n = Narrator()
    for image in (RUNTIME, OPERATOR):
        if not have_image(image):
            raise SystemExit(f"demo-cluster: {image} is not built: run `make images` "
                             "(scripts/images.sh), or `make demo-cluster`, which builds it")
    with contextlib.ExitStack() as stack:
        n.title("Start a local Kubernetes control plane (etcd, kube-apiserver, controller-manager, "
                "scheduler, kwok) on 127.0.0.1")
        try:
            cluster = stack.enter_context(open_cluster())
        except (MissingBinariesError, ComponentError) as exc:
            raise SystemExit(f"demo-cluster: {exc}") from None
        if not cluster.local:
            raise SystemExit("demo-cluster: it needs the local control plane (its loopback "
                             "nodes): unset KVFLEET_TEST_KUBECONFIG")
        work = Path(tempfile.mkdtemp(prefix="kvfleet-demo-cluster-"))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        n.say(f"kubectl and helm talk to it with KUBECONFIG={cluster.kubeconfig}. Pods land on "
              "two kwok nodes with 8 fake GPUs each; the kubelet shim runs each replica and router "
              "pod as a real process inside the built runtime image, and the operator pod inside "
              "the built operator image, at the pod's own IP.")
        nodes = create_loopback_nodes(cluster)
        stack.callback(lambda: [cluster.kubectl("delete", "node", x, "--ignore-not-found",
                                                check=False) for x in nodes])
        cluster.kubectl("create", "namespace", NAMESPACE)
        models = work / "models"
        models.mkdir()
        digests = {"v1": generate_model(models, seed=0), "v2": generate_model(models, seed=1)}
        redis = Redis(work)
        stack.callback(redis.close)
        prometheus = Prometheus(work)
        stack.callback(prometheus.close)
        containers = {}
        for image in (RUNTIME, OPERATOR):
            containers[image] = stack.enter_context(working_container(image, "kvfleet-demo"))
            stale = containers[image].stale_sources()
            if stale:
                raise SystemExit(f"demo-cluster: {image} was built from other sources "
                                 f"({len(stale)} files differ): run `make images`")
        (work / "pods").mkdir()
        shim = KubeletShim(
            cluster, NAMESPACE, work / "pods", selector=f"app.kubernetes.io/instance={RELEASE}",
            nodes=set(nodes), container=containers[RUNTIME],
            operator_container=containers[OPERATOR],
            on_change=lambda pods: prometheus.set_targets(
                [p for p in pods if p.labels.get("app.kubernetes.io/component") == "replica"]))
        shim.start()
        stack.callback(shim.close)
        replica_port, router_port = free_port(), free_port()
        values_file = work / "my-values.yaml"
        demo_values = values(models, digests["v1"], replica_port, router_port, redis.url)
        # The operator on the e2e nodes (the shim runs it), looking at rollouts every second and
        # at policies every 2 s (10 s by default: a demo would wait for it).
        demo_values["operator"] = {
            "nodeSelector": demo_values["router"]["nodeSelector"],  # type: ignore[index]
            "extraEnv": [{"name": "KVFLEET_OPERATOR_ROLLOUT_INTERVAL_S", "value": "1"},
                         {"name": "KVFLEET_OPERATOR_POLICY_INTERVAL_S", "value": "2"}],
        }
        values_file.write_text(yaml.safe_dump(demo_values))

        def diagnostics() -> str:
            return cluster.kubectl("get", "-n", NAMESPACE, "pods,mro", "-o", "wide",
                                   check=False).stdout + f"\nlogs under {work}"

        n.title("helm install the chart (replicas serve weights v1, the router, the operator)")
        out = cluster.helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "-f",
                           str(values_file), "--wait=false", timeout_s=180).stdout
        stack.callback(lambda: cluster.helm("uninstall", RELEASE, "-n", NAMESPACE,
                                            "--wait=false", check=False))
        n.show(f"helm install {RELEASE} charts/kvfleet -n {NAMESPACE} -f my-values.yaml",
               "\n".join(out.splitlines()[:6]))
        n.say("The shim runs the chart's operator pod from the operator image, with what a "
              "kubelet gives a pod: its ServiceAccount's token and the cluster's CA under "
              "/var/run/secrets/kubernetes.io/serviceaccount and KUBERNETES_SERVICE_HOST/PORT, so "
              "kopf logs in in-cluster, with exactly the chart's RBAC.")
        wait_for(lambda: shim.running(OPERATOR_POD), "the operator pod's process", 180,
                 diagnostics)
        wait_for(lambda: len([p for p in shim.running(REPLICA) if _serves(p, digests["v1"])]) == 2,
                 "both replica processes serve v1", 180, diagnostics)
        n.show(f"kubectl get pods -n {NAMESPACE} -o wide",
               cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide").stdout)

        n.title("kubectl apply a KVCachePolicy")
        policy = ROOT / "examples" / "kvcachepolicy.yaml"
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(policy))
        patch = {"spec": {
            "selector": {"matchLabels": {"app": None, "app.kubernetes.io/name": "kvfleet-replica",
                                         "app.kubernetes.io/instance": RELEASE}},
            "replicaPort": replica_port,
            "tenants": [tenant_name(i) for i in range(NUM_TENANTS)],
            "affinity": {"k": 1},
        }}
        cluster.kubectl("patch", "-n", NAMESPACE, "kvcachepolicy", "chat", "--type=merge", "-p",
                        json.dumps(patch))
        wait_for(lambda: "True" in cluster.kubectl("get", "-n", NAMESPACE, "kvcp", "chat").stdout,
                 "the policy Ready", 90, diagnostics)
        n.show(f"kubectl get kvcachepolicy -n {NAMESPACE} -o wide",
               cluster.kubectl("get", "-n", NAMESPACE, "kvcachepolicy", "-o", "wide").stdout)
        n.say("TIERS: the tiers the break-even arithmetic turned on for the policy's model and "
              "GPUs (NVMe stays off below BREAKEVEN, the bandwidth at which fetching a prefix's KV "
              "costs as much as recomputing it); REPLICAS and TENANTS: the home sets the operator "
              "published into ConfigMap chat-fleet, which the router and replicas read.")

        n.title("Traffic through the router (the vendored trace, 48 tenants)")
        router = wait_for(lambda: shim.running(ROUTER), "the router process", 90, diagnostics)[0]
        wait_for(lambda: http_json(f"{router.url}/readyz")[0] == 200, "router ready", 90,
                 diagnostics)
        traffic = Traffic(router.url, load_requests(), MODEL_ID)
        traffic.start()
        stack.callback(traffic.stop)
        wait_for(lambda: traffic.hit_rate(10) > 0.8, "the warm caches hit", 180,
                 lambda: traffic.summary(10))
        n.say(f"router {router.url}: {traffic.summary(10)}")

        n.title("A ModelRollout whose canary can never hit: rolled back on the hit-rate alarm")
        n.say(f"The canary runs image {UNSTABLE_KEY_IMAGE}: its cache key changes on every "
              "request, as when a key field (KV dtype, RoPE config, attention id) changed by "
              "mistake.")
        stable_before = _replica_sets(cluster)
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-",
                        stdin=_rollout("bad", digests["v2"], prometheus.url, 50,
                                       image=UNSTABLE_KEY_IMAGE))
        _watch_rollout(n, cluster, "bad", {"RolledBack", "Succeeded", "Failed"}, 240, diagnostics)
        n.show(f"kubectl get kvcachepolicy,modelrollout -n {NAMESPACE} -o wide",
               cluster.kubectl("get", "-n", NAMESPACE, "kvcachepolicy,modelrollout",
                               "-o", "wide").stdout)
        n.show("kubectl get events --field-selector involvedObject.name=bad",
               _events(cluster, "bad"))
        n.say("HITRATE is the canary's cache hit rate, BASELINE the stable fleet's; the step's "
              "window closed with the canary far below 90% of the baseline, so the operator "
              "restored the stable version and size, deleted the canary and said why (REASON "
              "HitRateNotRecovered).")
        stable_after = _replica_sets(cluster)
        n.show(f"kubectl get replicasets -n {NAMESPACE} -l {REPLICA}",
               cluster.kubectl("get", "replicasets", "-n", NAMESPACE, "-l", REPLICA).stdout)
        same = "the same" if stable_after == stable_before else "NOT the same"
        n.say(f"The stable Deployment runs {same} ReplicaSet as before the rollout "
              f"({', '.join(stable_after)}): its template came back byte for byte, so the pod that "
              "kept serving kept its warm cache; only the one scaled away for the canary's share "
              "was re-created.")

        n.title("A ModelRollout of new weights (v2): promoted step by step")
        cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-",
                        stdin=_rollout("v2", digests["v2"], prometheus.url, 150))
        _watch_rollout(n, cluster, "v2", {"Succeeded", "RolledBack", "Failed"}, 420, diagnostics)
        n.show(f"kubectl get modelrollout -n {NAMESPACE} -o wide",
               cluster.kubectl("get", "-n", NAMESPACE, "modelrollout", "-o", "wide").stdout)
        n.show("kubectl get events --field-selector involvedObject.name=v2", _events(cluster, "v2"))
        n.say("Each step waited for the canary's hit rate to recover to 90% of the stable's before "
              "the next; at the end the chart's Deployment runs v2 and the canary is gone. Set "
              "replica.model.weightsDigest to v2 before the next `helm upgrade` "
              "(docs/quickstart.md step 8).")
        n.say(f"traffic during the demo: {traffic.summary(time.monotonic() - n.started)}")
        if keep:
            n.title(f"Up until Ctrl-C: KUBECONFIG={cluster.kubeconfig} kubectl get pods,kvcp,mro "
                    f"-n {NAMESPACE}; router {router.url}")
            while True:
                time.sleep(3600)
        n.title("Clean up: every process stopped, the cluster removed")


def _replica_sets(cluster: Cluster) -> list[str]:
    """The stable Deployment's ReplicaSets that have pods (a new template makes a new one)."""
    items = json.loads(cluster.kubectl("get", "replicasets", "-n", NAMESPACE, "-l", REPLICA,
                                       "-o", "json").stdout)["items"]
    return sorted(rs["metadata"]["name"] for rs in items
                  if "-canary-" not in rs["metadata"]["name"]
                  and int(rs["spec"].get("replicas") or 0) > 0)


def _serves(pod: Any, digest: str) -> bool:
    status, body = http_json(f"{pod.url}/readyz", timeout_s=3)
    return status == 200 and isinstance(body, dict) and body.get("weights_digest") == digest


def main() -> int:
    parser = argparse.ArgumentParser(prog="make demo-cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="stay up at the end until Ctrl-C")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run(args.keep)
    except KeyboardInterrupt:
        _print("\ninterrupted: every process stopped, the cluster removed", err=True)
        return 130
    _print("\nnext: docs/quickstart.md does the same on a GPU cluster; docs/operator.md explains "
          "each field and column.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
