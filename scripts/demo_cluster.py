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
like. Ctrl-C (or SIGTERM) at any point stops every process and removes the cluster; a failure
stops every process too and keeps the processes' logs, saying where.

    scripts/demo-cluster.sh [--keep]     # --keep: stay up at the end until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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

from tests.cluster.api import ApiClient, ApiError  # noqa: E402
from tests.cluster.binaries import MissingBinariesError  # noqa: E402
from tests.cluster.cluster import Cluster, CommandError, open_cluster  # noqa: E402
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
from tests.images.buildah import checkout_image, have_image, working_container  # noqa: E402

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
# How long a kubectl command is asked again while the API server does not answer: on two cores
# shared with other work a TLS handshake can miss client-go's 10 s; past this it is down.
KUBECTL_RETRY_S = 90.0
KUBECTL_RETRY_PAUSE_S = 2.0
# A rollout's row is printed when its phase, step or reason changes, and at least this often.
WATCH_ROW_S = 15.0
# What kubectl prints when the request never got an answer (not when the server said no).
TRANSIENT = ("Unable to connect to the server", "TLS handshake timeout", "i/o timeout",
             "connection refused", "connection reset", "context deadline exceeded",
             "Client.Timeout", "(Timeout)", "(ServiceUnavailable)", "etcdserver: request timed out",
             "timed out after", "\": EOF")


class DemoError(Exception):
    """A step did not do what the demo says it does; the message says which and why."""


def _print(text: str, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    with contextlib.suppress(OSError):  # a closed pipe (`| tee` stopped by the same Ctrl-C)
        stream.write(text + "\n")
        stream.flush()


class Narrator:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.step = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def title(self, text: str) -> None:
        self.step += 1
        _print(f"\n[{self.elapsed():4.0f}s] {self.step}. {text}")

    def say(self, text: str) -> None:
        _print(textwrap.fill(text, 100, initial_indent="   ", subsequent_indent="   ",
                             break_on_hyphens=False, break_long_words=False))

    def show(self, command: str, output: str) -> None:
        _print(f"\n   $ {command}")
        _print(textwrap.indent(output.rstrip(), "   "))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # Once: a second Ctrl-C must not cut the cleanup short (it would leave processes behind).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def kubectl(cluster: Cluster, *args: str, stdin: str | None = None) -> str:
    """kubectl's stdout; asked again while the API server does not answer (TRANSIENT), for up
    to KUBECTL_RETRY_S. Every command the demo sends is safe to repeat (get, apply, patch)."""
    deadline = time.monotonic() + KUBECTL_RETRY_S
    while True:
        try:
            return cluster.kubectl(*args, stdin=stdin, timeout_s=60).stdout
        except CommandError as exc:
            if not any(t in exc.stderr for t in TRANSIENT):
                raise DemoError(f"`kubectl {' '.join(args)}` failed: {exc.stderr.strip()}") \
                    from None
            if time.monotonic() > deadline:
                raise DemoError(f"`kubectl {' '.join(args)}`: the API server did not answer for "
                                f"{KUBECTL_RETRY_S:.0f} s (load average {_load()}); last error: "
                                f"{exc.stderr.strip()[-500:]}") from None
            time.sleep(KUBECTL_RETRY_PAUSE_S)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


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
    doc["spec"]["gate"].update(windowSeconds=window_s, holdSeconds=5, readyTimeoutSeconds=180,
                               checkIntervalSeconds=1)
    doc["spec"]["surge"] = {"mode": "None"}  # two cores: no extra canary processes
    doc["spec"]["metrics"]["prometheus"] = {"url": prometheus_url, "hitRateQuery": HIT_RATE_QUERY}
    return yaml.safe_dump(doc)


def _get(api: ApiClient, resource: str, name: str) -> dict[str, Any]:
    """A kvfleet.dev object of the demo's namespace; {} when the API server did not answer this
    time (the caller asks again)."""
    try:
        return dict(api.get(f"/apis/kvfleet.dev/v1alpha1/namespaces/{NAMESPACE}/{resource}/{name}"))
    except ApiError:
        return {}


def _events(cluster: Cluster, name: str) -> str:
    return kubectl(
        cluster, "get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp",
        "--field-selector", f"involvedObject.kind=ModelRollout,involvedObject.name={name}",
        "-o", "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message")


def _watch_rollout(cluster: Cluster, api: ApiClient, name: str, phases: set[str],
                   timeout_s: float, diagnostics: Callable[[], str]) -> dict[str, Any]:
    """Print the rollout's row as `kubectl get mro -w` shows it: when its phase, step or reason
    changes, and every WATCH_ROW_S in between (the hit rates move every scrape); return its
    status once its phase is one of `phases`."""
    last: tuple[str, ...] = ()
    printed = 0.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _get(api, "modelrollouts", name).get("status") or {}
        key = tuple(str(status.get(k)) for k in ("phase", "currentStep", "reason", "stepState"))
        if status and (key != last or time.monotonic() - printed >= WATCH_ROW_S):
            table = cluster.kubectl("get", "-n", NAMESPACE, "mro", name, "-o", "wide",
                                    check=False, timeout_s=60).stdout.splitlines()
            if len(table) == 2:
                if not last:
                    _print("   " + table[0])
                _print("   " + table[1])
                last, printed = key, time.monotonic()
        if status.get("phase") in phases:
            return dict(status)
        time.sleep(2)
    raise DemoError(f"ModelRollout {name} did not reach {' or '.join(sorted(phases))} in "
                    f"{timeout_s:.0f} s (load average {_load()})\n{diagnostics()}")


def _ready(obj: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _stable_pods(cluster: Cluster) -> dict[str, str]:
    """The stable Deployment's replica pods that are not terminating: name -> ReplicaSet."""
    items = json.loads(kubectl(cluster, "get", "pods", "-n", NAMESPACE, "-l", REPLICA,
                               "-o", "json"))["items"]
    return {p["metadata"]["name"]: p["metadata"]["ownerReferences"][0]["name"] for p in items
            if "-canary-" not in p["metadata"]["name"]
            and not p["metadata"].get("deletionTimestamp")}


def run(keep: bool, n: Narrator, keep_logs: Callable[..., None]) -> None:
    images = {kind: checkout_image(kind) for kind in ("runtime", "operator")}
    for image in images.values():
        if not have_image(image):
            raise DemoError(f"{image} (this checkout's build) is not there: run `make images` "
                            "(scripts/images.sh), or `make demo-cluster`, which builds it")
    with contextlib.ExitStack() as stack:
        n.title("Open this checkout's runtime and operator images; generate two tiny checkpoints "
                "(weights v1 and v2)")
        work = Path(tempfile.mkdtemp(prefix="kvfleet-demo-cluster-"))
        stack.callback(keep_logs, work)
        containers = {}
        for kind, image in images.items():
            containers[kind] = stack.enter_context(working_container(image, "kvfleet-demo"))
            stale = containers[kind].stale_sources()
            if stale:  # the tag says these sources; a mismatch is a fault of the build's cache
                raise DemoError(f"{image} holds other sources than this checkout "
                                f"({len(stale)} files differ, e.g. {stale[0]}): run `make images`")
        models = work / "models"
        models.mkdir()
        try:
            digests = {"v1": generate_model(models, seed=0), "v2": generate_model(models, seed=1)}
        except RuntimeError as exc:
            raise DemoError(str(exc)) from None
        n.say(f"images {images['runtime']} and {images['operator']}; weights v1 "
              f"{digests['v1'][:19]}..., v2 {digests['v2'][:19]}... (`kvfleet model generate "
              "--preset tiny`), one folder per digest as the chart's model volume expects.")

        n.title("Start a local Kubernetes control plane (etcd, kube-apiserver, controller-manager, "
                "scheduler, kwok) on 127.0.0.1")
        try:
            cluster = stack.enter_context(open_cluster())
        except (MissingBinariesError, ComponentError) as exc:
            raise DemoError(str(exc)) from None
        if not cluster.local:
            raise DemoError("it needs the local control plane (its loopback nodes): unset "
                            "KVFLEET_TEST_KUBECONFIG")
        # Before the control plane stops (last in, first out) its logs; open_cluster removes it.
        stack.callback(keep_logs, cluster.work_dir, False)
        n.say(f"kubectl and helm talk to it with KUBECONFIG={cluster.kubeconfig}. Pods land on "
              "two kwok nodes with 8 fake GPUs each; the kubelet shim runs each replica and router "
              "pod as a real process inside the built runtime image, and the operator pod inside "
              "the built operator image, at the pod's own IP.")
        api = ApiClient(cluster.kubeconfig)
        stack.callback(api.close)
        nodes = create_loopback_nodes(cluster)
        kubectl(cluster, "apply", "-f", "-", stdin=json.dumps(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}))
        redis = Redis(work)
        stack.callback(redis.close)
        prometheus = Prometheus(work)
        stack.callback(prometheus.close)
        (work / "pods").mkdir()
        shim = KubeletShim(
            cluster, NAMESPACE, work / "pods", selector=f"app.kubernetes.io/instance={RELEASE}",
            nodes=set(nodes), container=containers["runtime"],
            operator_container=containers["operator"],
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
            return (cluster.kubectl("get", "-n", NAMESPACE, "pods,mro", "-o", "wide",
                                    check=False).stdout
                    + "".join(f"\nshim: {e}" for e in shim.errors[-5:]))

        n.title("helm install the chart (replicas serve weights v1, the router, the operator)")
        out = cluster.helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "-f",
                           str(values_file), "--wait=false", timeout_s=300).stdout
        n.show(f"helm install {RELEASE} charts/kvfleet -n {NAMESPACE} -f my-values.yaml",
               "\n".join(out.splitlines()[:6]))
        n.say("The shim runs the chart's operator pod from the operator image, with what a "
              "kubelet gives a pod: its ServiceAccount's token and the cluster's CA under "
              "/var/run/secrets/kubernetes.io/serviceaccount and KUBERNETES_SERVICE_HOST/PORT, so "
              "kopf logs in in-cluster, with exactly the chart's RBAC.")
        wait_for(lambda: shim.running(OPERATOR_POD), "the operator pod's process", 180,
                 diagnostics)
        wait_for(lambda: len([p for p in shim.running(REPLICA) if _serves(p, digests["v1"])]) == 2,
                 "both replica processes serve v1", 300, diagnostics)
        n.show(f"kubectl get pods -n {NAMESPACE} -o wide",
               kubectl(cluster, "get", "pods", "-n", NAMESPACE, "-o", "wide"))

        n.title("kubectl apply a KVCachePolicy")
        policy = ROOT / "examples" / "kvcachepolicy.yaml"
        kubectl(cluster, "apply", "-n", NAMESPACE, "-f", str(policy))
        patch = {"spec": {
            "selector": {"matchLabels": {"app": None, "app.kubernetes.io/name": "kvfleet-replica",
                                         "app.kubernetes.io/instance": RELEASE}},
            "replicaPort": replica_port,
            "tenants": [tenant_name(i) for i in range(NUM_TENANTS)],
            "affinity": {"k": 1},
        }}
        kubectl(cluster, "patch", "-n", NAMESPACE, "kvcachepolicy", "chat", "--type=merge", "-p",
                json.dumps(patch))
        n.say("(examples/kvcachepolicy.yaml, patched for this release: its replica pods' labels "
              "and port, the trace's 48 tenants, one home replica each.)")
        wait_for(lambda: _ready(_get(api, "kvcachepolicies", "chat")),
                 "the policy Ready (the operator pod logged in and reconciled it)", 240,
                 diagnostics)
        n.show(f"kubectl get kvcachepolicy -n {NAMESPACE} -o wide",
               kubectl(cluster, "get", "-n", NAMESPACE, "kvcachepolicy", "-o", "wide"))
        n.say("TIERS: the tiers the break-even arithmetic turned on for the policy's model and "
              "GPUs (NVMe stays off below BREAKEVEN, the bandwidth at which fetching a prefix's KV "
              "costs as much as recomputing it); REPLICAS and TENANTS: the ready replica pods and "
              "tenants the operator planned home sets over. It published the tiers and the "
              "replica list as ConfigMap chat-fleet, from which the router and the replicas rank "
              "each tenant's home replicas.")

        n.title("Traffic through the router (the vendored trace, 48 tenants)")
        router = wait_for(lambda: shim.running(ROUTER), "the router process", 180, diagnostics)[0]
        wait_for(lambda: http_json(f"{router.url}/readyz")[0] == 200, "router ready", 180,
                 diagnostics)
        traffic = Traffic(router.url, load_requests(), MODEL_ID)
        traffic.start()
        stack.callback(traffic.stop)
        wait_for(lambda: traffic.hit_rate(10) > 0.8, "the warm caches hit (token hit rate > 0.8)",
                 240, lambda: traffic.summary(10))
        n.say(f"router {router.url}: {traffic.summary(10)}")

        n.title("A ModelRollout whose canary can never hit: rolled back on the hit-rate alarm")
        n.say(f"The canary runs image {UNSTABLE_KEY_IMAGE}: its cache key changes on every "
              "request, as when a key field (KV dtype, RoPE config, attention id) changed by "
              "mistake.")
        stable_before = _stable_pods(cluster)
        kubectl(cluster, "apply", "-n", NAMESPACE, "-f", "-",
                stdin=_rollout("bad", digests["v2"], prometheus.url, 50, image=UNSTABLE_KEY_IMAGE))
        n.show(f"kubectl get modelrollout bad -n {NAMESPACE} -o wide -w", "")
        status = _watch_rollout(cluster, api, "bad", {"RolledBack", "Succeeded", "Failed"}, 420,
                                diagnostics)
        if status.get("phase") != "RolledBack" or status.get("reason") != "HitRateNotRecovered":
            raise DemoError(f"the bad canary ended {status.get('phase')} ({status.get('reason')}): "
                            f"{status.get('message')}\n{diagnostics()}")
        n.show(f"kubectl get kvcachepolicy,modelrollout -n {NAMESPACE} -o wide",
               kubectl(cluster, "get", "-n", NAMESPACE, "kvcachepolicy,modelrollout", "-o", "wide"))
        n.show("kubectl get events --field-selector involvedObject.name=bad",
               _events(cluster, "bad"))
        n.say(f"HITRATE is the canary's cache hit rate ({status.get('hitRatePercent')}), BASELINE "
              f"the stable fleet's ({status.get('baselinePercent')}); REASON "
              f"{status.get('reason')}: the canary did not reach 90% of the baseline within the "
              "step's window, so the operator restored the stable version and size and deleted "
              f"the canary. Its message: {status.get('message')}")
        stable_after = _stable_pods(cluster)
        n.show(f"kubectl get replicasets -n {NAMESPACE} -l {REPLICA}",
               kubectl(cluster, "get", "replicasets", "-n", NAMESPACE, "-l", REPLICA))
        before_sets, after_sets = set(stable_before.values()), set(stable_after.values())
        kept = sorted(set(stable_after) & set(stable_before))
        new_pods = sorted(set(stable_after) - set(stable_before))
        if before_sets == after_sets:
            n.say(f"The stable Deployment runs the same ReplicaSet as before the rollout "
                  f"({', '.join(sorted(after_sets))}): its template came back byte for byte. "
                  f"Pods kept, with their warm caches: {', '.join(kept) or 'none'}; created "
                  f"again: {', '.join(new_pods) or 'none'} (the share scaled away for the "
                  "canary).")
        else:
            n.say(f"The stable Deployment's ReplicaSet changed ({', '.join(sorted(before_sets))} "
                  f"-> {', '.join(sorted(after_sets))}): the rollback did not restore its "
                  "template byte for byte, so its pods were replaced with cold caches.")

        n.title("A ModelRollout of new weights (v2): promoted step by step")
        kubectl(cluster, "apply", "-n", NAMESPACE, "-f", "-",
                stdin=_rollout("v2", digests["v2"], prometheus.url, 150))
        n.show(f"kubectl get modelrollout v2 -n {NAMESPACE} -o wide -w", "")
        status = _watch_rollout(cluster, api, "v2", {"Succeeded", "RolledBack", "Failed"}, 600,
                                diagnostics)
        if status.get("phase") != "Succeeded":
            raise DemoError(f"the v2 rollout ended {status.get('phase')} ({status.get('reason')}): "
                            f"{status.get('message')}\n{diagnostics()}")
        n.show(f"kubectl get modelrollout -n {NAMESPACE} -o wide",
               kubectl(cluster, "get", "-n", NAMESPACE, "modelrollout", "-o", "wide"))
        n.show("kubectl get events --field-selector involvedObject.name=v2", _events(cluster, "v2"))
        n.say("Each step waited for the canary's hit rate to recover to 90% of the stable's before "
              "the next; at the end the chart's Deployment runs v2 and the canary is gone. Set "
              "replica.model.weightsDigest to v2 before the next `helm upgrade` "
              "(docs/quickstart.md step 8).")
        n.say(f"traffic during the demo: {traffic.summary(n.elapsed())}")
        if keep:
            n.title(f"Up until Ctrl-C: KUBECONFIG={cluster.kubeconfig} kubectl get pods,kvcp,mro "
                    f"-n {NAMESPACE}; router {router.url}")
            while True:
                time.sleep(3600)
        n.title("Clean up: every process stopped, the cluster removed")


def _serves(pod: Any, digest: str) -> bool:
    status, body = http_json(f"{pod.url}/readyz", timeout_s=3)
    return status == 200 and isinstance(body, dict) and body.get("weights_digest") == digest


def main() -> int:
    parser = argparse.ArgumentParser(prog="make demo-cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="stay up at the end until Ctrl-C")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    n = Narrator()
    failed: list[str] = []
    kept = Path(tempfile.gettempdir()) / f"kvfleet-demo-cluster-logs-{os.getpid()}"

    def keep_logs(folder: Path, remove: bool = True) -> None:
        """A failed run's logs are copied to `kept` (every process is stopped either way)."""
        if failed:
            shutil.copytree(folder, kept / folder.name, dirs_exist_ok=True, symlinks=True,
                            ignore_dangling_symlinks=True,
                            ignore=shutil.ignore_patterns("models", "tsdb", "etcd", "pki"))
        if remove:
            shutil.rmtree(folder, ignore_errors=True)

    try:
        try:
            run(args.keep, n, keep_logs)
        except (DemoError, AssertionError, CommandError) as exc:
            failed.append(str(exc))
            raise
    except KeyboardInterrupt:
        _print(f"\ninterrupted after {n.elapsed():.0f} s: every process stopped, the cluster "
               "removed", err=True)
        return 130
    except (DemoError, AssertionError, CommandError) as exc:
        logs = f"; their logs are in {kept}" if kept.exists() else ""
        _print(f"\ndemo-cluster failed after {n.elapsed():.0f} s: {exc}\nevery process "
               f"stopped{logs}", err=True)
        return 1
    _print(f"\ndone in {n.elapsed():.0f} s, cleanup included.\nnext: docs/quickstart.md does the "
           "same on a GPU cluster; docs/operator.md explains each field and column.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
