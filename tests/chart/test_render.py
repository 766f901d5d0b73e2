"""`helm lint` and `helm template` of the chart's main scenarios, asserted on the parsed objects:
labels and selectors, probes, GPU resources, the mounted fleet ConfigMap and secrets, Redis
bundled or external, and the monitoring objects rendered only when their API exists."""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_runtime.affinity.api_keys import load_api_keys
from kvfleet_runtime.auth import hint_key
from kvfleet_runtime.config.fleet import FLEET_CONFIG_FILENAME
from tests.chart.conftest import (
    CHART,
    CI_VALUES,
    MONITORING_APIS,
    NAMESPACE,
    RELEASE,
    ROOT,
    Render,
    Rendered,
    kube_version,
    kvfleet_cli_params,
    run_helm,
    template_args,
)

DEFAULT = "default-values.yaml"
EXTERNAL_REDIS = "external-redis-values.yaml"
EXTERNAL_SECRETS = "external-redis-secret-values.yaml"
MONITORING = "monitoring-values.yaml"

STANDARD_LABELS = {
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
    "app.kubernetes.io/part-of", "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
    "helm.sh/chart",
}
SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance"}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
DIGEST = "sha256:" + "ab" * 32
CI_DIGEST = "sha256:4f1c7fb2a0c94f7c6b57e2a1d5b3e8c9a0f1e2d3c4b5a69788796a5b4c3d2e1f"


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def _container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in _pod_spec(obj)["containers"] if c["name"] == name]
    return found


def _volume(obj: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [v for v in _pod_spec(obj)["volumes"] if v["name"] == name]
    return found


def _mount(container: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [m for m in container["volumeMounts"] if m["name"] == name]
    return found


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# ------------------------------------------------------------------------------------------------
# helm lint


@pytest.mark.parametrize("name", sorted(p.name for p in CI_VALUES.glob("*-values.yaml")))
def test_helm_lint_is_clean(helm: Path, helm_env: dict[str, str], name: str) -> None:
    result = run_helm(
        helm, helm_env, "lint", "--strict", str(CHART), "--values", str(CI_VALUES / name),
        "--kube-version", kube_version(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    problems = [ln for ln in result.stdout.splitlines() if ln.startswith(("[ERROR]", "[WARNING]"))]
    assert not problems, problems


def test_missing_model_volume_fails_with_a_clear_message(
    helm: Path, helm_env: dict[str, str]
) -> None:
    result = run_helm(helm, helm_env, *template_args([]))
    assert result.returncode != 0
    assert "replica.model.volume is required" in result.stderr


def test_missing_weights_digest_fails_with_a_clear_message(
    helm: Path, helm_env: dict[str, str]
) -> None:
    result = run_helm(
        helm, helm_env, *template_args([DEFAULT], ["replica.model.weightsDigest="])
    )
    assert result.returncode != 0
    assert "replica.model.weightsDigest is required" in result.stderr
    # A fixed folder needs no digest.
    fixed = ["replica.model.weightsDigest=", "replica.model.dir=/models/llama", "replica.model.id="]
    assert run_helm(helm, helm_env, *template_args([DEFAULT], fixed)).returncode == 0


def test_unknown_value_is_refused_by_the_schema(helm: Path, helm_env: dict[str, str]) -> None:
    result = run_helm(helm, helm_env, *template_args([DEFAULT], ["replica.gpus=2"]))
    assert result.returncode != 0
    assert "gpus" in result.stderr and "additional" in result.stderr.lower(), result.stderr


# ------------------------------------------------------------------------------------------------
# what the default install renders


def test_default_renders_the_fleet(render: Render) -> None:
    out = render(DEFAULT)
    names = set(out.names())
    for expected in (
        "Deployment/kvfleet-replica", "Service/kvfleet-replica",
        "Deployment/kvfleet-router", "Service/kvfleet-router", "Secret/kvfleet-router-keys",
        "Deployment/kvfleet-redis", "Service/kvfleet-redis",
        "Secret/kvfleet-peer",
    ):
        assert expected in names, f"{expected} missing from {sorted(names)}"
    assert not out.of_kind("ServiceMonitor") and not out.of_kind("PrometheusRule")
    assert all(o["metadata"].get("namespace", NAMESPACE) == NAMESPACE for o in out)


@pytest.mark.parametrize("scenario", [DEFAULT, EXTERNAL_REDIS, EXTERNAL_SECRETS, MONITORING])
def test_every_object_carries_the_standard_labels(render: Render, scenario: str) -> None:
    for obj in render(scenario, api_versions=MONITORING_APIS):
        labels = obj["metadata"].get("labels", {})
        missing = STANDARD_LABELS - set(labels)
        assert not missing, f"{obj['kind']}/{obj['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


@pytest.mark.parametrize("scenario", [DEFAULT, MONITORING])
def test_selectors_are_name_and_instance_only_and_match_their_pods(
    render: Render, scenario: str
) -> None:
    out = render(scenario, api_versions=MONITORING_APIS)
    pod_labels = {}
    for kind in WORKLOADS:
        for obj in out.of_kind(kind):
            selector = obj["spec"]["selector"]
            assert set(selector) == {"matchLabels"}, selector
            match = selector["matchLabels"]
            assert set(match) == SELECTOR_KEYS, f"{obj['metadata']['name']}: {match}"
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert match.items() <= labels.items()
            assert set(labels) >= STANDARD_LABELS
            pod_labels[obj["metadata"]["name"]] = labels
    assert len({tuple(sorted(s.items())) for s in pod_labels.values()}) == len(pod_labels)
    for svc in out.of_kind("Service"):
        selector = svc["spec"]["selector"]
        assert set(selector) == SELECTOR_KEYS, f"{svc['metadata']['name']}: {selector}"
        selected = [n for n, labels in pod_labels.items() if selector.items() <= labels.items()]
        assert selected == [svc["metadata"]["name"]], (
            f"Service {svc['metadata']['name']} selects the pods of {selected}"
        )
        # Every Service port points at a named container port of the pods it selects.
        workload = out.get("Deployment", selected[0])
        port_names = {p["name"] for c in _pod_spec(workload)["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names


def test_pods_run_as_non_root_without_privileges(render: Render) -> None:
    for obj in render(DEFAULT).of_kind("Deployment"):
        spec = _pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"]["drop"] == ["ALL"]


# ------------------------------------------------------------------------------------------------
# the replica workload


def test_replica_asks_for_its_gpus(render: Render) -> None:
    default = _container(render(DEFAULT).get("Deployment", "kvfleet-replica"), "replica")
    assert default["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert default["resources"]["requests"]["nvidia.com/gpu"] == 1
    out = render(MONITORING)
    tp2 = out.get("Deployment", "kvfleet-replica")
    assert tp2["spec"]["replicas"] == 4
    assert _container(tp2, "replica")["resources"]["limits"]["nvidia.com/gpu"] == 2
    tolerations = _pod_spec(tp2)["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


def test_replica_probes_use_its_health_endpoints(render: Render) -> None:
    c = _container(render(DEFAULT).get("Deployment", "kvfleet-replica"), "replica")
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # Loading weights may take minutes: the startup probe holds liveness off meanwhile.
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]


def test_replica_runs_the_replica_command_on_the_mounted_model(render: Render) -> None:
    obj = render(DEFAULT).get("Deployment", "kvfleet-replica")
    c = _container(obj, "replica")
    assert c["image"] == "kvfleet/kvfleet-runtime:0.1.0"
    args = c["args"]
    # The replica's own command line accepts what the chart passes.
    params = kvfleet_cli_params(args)
    assert params["port"] == 8000 and params["host"] == "0.0.0.0"
    assert params["model_id"] == "llama-3.1-8b"
    assert str(params["config"]) == "/etc/kvfleet/replica/replica.yaml"
    assert _mount(c, "replica-config")["mountPath"] == "/etc/kvfleet/replica"
    assert _volume(obj, "replica-config")["configMap"] == {"name": "kvfleet-replica"}
    # Kubernetes expands $(KVFLEET_WEIGHTS_DIGEST) from the container's env: the folder of the
    # digest this template runs, which a ModelRollout's canary replaces.
    assert args[args.index("--model-dir") + 1] == "/models/$(KVFLEET_WEIGHTS_DIGEST)"
    assert _env(c)["KVFLEET_WEIGHTS_DIGEST"] == CI_DIGEST
    assert args[args.index("--port") + 1] == "8000"
    assert _mount(c, "model") == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert _volume(obj, "model")["persistentVolumeClaim"] == {
        "claimName": "llama-weights", "readOnly": True,
    }


@pytest.mark.parametrize("scenario", [DEFAULT, MONITORING])
def test_replica_settings_file_is_one_the_replica_loads(
    render: Render, scenario: str, tmp_path: Path
) -> None:
    from kvfleet_runtime.server import load_config

    text = render(scenario).get("ConfigMap", "kvfleet-replica")["data"]["replica.yaml"]
    path = tmp_path / "replica.yaml"
    path.write_text(text)
    config = load_config(path, environ={})
    if scenario == MONITORING:
        assert config.cache.num_t1_blocks == 65536
        assert config.limits.max_prompt_tokens == 8192


def test_replica_needs_a_served_model_name_with_digest_folders(
    helm: Path, helm_env: dict[str, str]
) -> None:
    result = run_helm(helm, helm_env, *template_args([DEFAULT], ["replica.model.id="]))
    assert result.returncode != 0 and "replica.model.id is required" in result.stderr


def test_fleet_config_map_is_mounted_in_router_and_replicas(render: Render) -> None:
    out = render(DEFAULT)
    for name, container in (("kvfleet-replica", "replica"), ("kvfleet-router", "router")):
        obj = out.get("Deployment", name)
        volume = _volume(obj, "fleet-config")
        # The operator publishes it: the pods start before it exists and see it when it does.
        assert volume["configMap"] == {"name": "kvfleet-fleet", "optional": True}
        mount = _mount(_container(obj, container), "fleet-config")
        assert mount["mountPath"] == "/etc/kvfleet/fleet" and mount["readOnly"] is True
    assert FLEET_CONFIG_FILENAME == "fleet.yaml"


def test_peer_transfer_secret_is_mounted_in_replicas(render: Render) -> None:
    out = render(DEFAULT)
    obj = out.get("Deployment", "kvfleet-replica")
    volume = _volume(obj, "peer-secret")["secret"]
    assert volume["secretName"] == "kvfleet-peer"
    secret = out.get("Secret", "kvfleet-peer")
    assert set(secret["data"]) == {volume["items"][0]["key"]}
    assert _mount(_container(obj, "replica"), "peer-secret")["readOnly"] is True
    # An existing Secret replaces the generated one.
    out = render(EXTERNAL_SECRETS)
    assert "Secret/kvfleet-peer" not in out.names()
    volume = _volume(out.get("Deployment", "kvfleet-replica"), "peer-secret")["secret"]
    assert volume["secretName"] == "peer-token" and volume["items"][0]["key"] == "token"


def test_weights_digest_is_annotated_for_the_operator(render: Render) -> None:
    obj = render(DEFAULT, set=[f"replica.model.weightsDigest={DIGEST}"]).get(
        "Deployment", "kvfleet-replica"
    )
    annotations = obj["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kvfleet.dev/weights-digest"] == DIGEST
    assert _env(_container(obj, "replica"))["KVFLEET_WEIGHTS_DIGEST"] == DIGEST


def test_weights_digest_names_match_the_operator() -> None:
    from kvfleet_operator.constants import DEFAULT_DIGEST_ENV, WEIGHTS_DIGEST_ANNOTATION

    assert WEIGHTS_DIGEST_ANNOTATION == "kvfleet.dev/weights-digest"
    assert DEFAULT_DIGEST_ENV == "KVFLEET_WEIGHTS_DIGEST"


# ------------------------------------------------------------------------------------------------
# the router


def test_router_service_and_keys_file(render: Render, tmp_path: Path) -> None:
    out = render(MONITORING)
    svc = out.get("Service", "kvfleet-router")
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    router = out.get("Deployment", "kvfleet-router")
    assert router["spec"]["replicas"] == 2
    c = _container(router, "router")
    # The router's own command line accepts what the chart passes.
    params = kvfleet_cli_params(c["args"])
    assert params["host"] == "0.0.0.0" and params["port"] == 8000
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    assert str(params["keys"]) == "/etc/kvfleet/router/keys.yaml"
    assert _mount(c, "api-keys")["mountPath"] == "/etc/kvfleet/router"
    assert _volume(router, "api-keys")["secret"]["items"] == [
        {"key": "keys.yaml", "path": "keys.yaml"}
    ]
    assert str(params["fleet_config"]) == f"/etc/kvfleet/fleet/{FLEET_CONFIG_FILENAME}"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    secret = out.get("Secret", "kvfleet-router-keys")
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(secret["stringData"]["keys.yaml"])
    # The file the chart writes is one the router's own loader accepts.
    keys = load_api_keys(keys_file)
    assert keys.tenant_for_key("sk-globex-test-1") == "globex"
    assert keys.tenant_for_key("test") == "acme"  # sha256("test") is acme's digest
    assert _volume(router, "api-keys")["secret"]["secretName"] == "kvfleet-router-keys"
    # A changed keys file restarts the routers.
    assert "checksum/keys" in router["spec"]["template"]["metadata"]["annotations"]


def test_router_pods_restart_when_keys_change(render: Render) -> None:
    def checksum(out: Rendered) -> str:
        template = out.get("Deployment", "kvfleet-router")["spec"]["template"]
        return template["metadata"]["annotations"]["checksum/keys"]

    before = checksum(render(DEFAULT))
    after = checksum(render(DEFAULT, set=["router.apiKeys.tenants.acme[0]=sk-new"]))
    assert before != after


# ------------------------------------------------------------------------------------------------
# Redis


def test_bundled_redis_is_an_ephemeral_hint_store(render: Render) -> None:
    out = render(DEFAULT)
    redis = out.get("Deployment", "kvfleet-redis")
    args = _container(redis, "redis")["args"]
    assert args[args.index("--save") + 1] == ""
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert out.get("Service", "kvfleet-redis")["spec"]["ports"][0]["port"] == 6379


def test_external_redis_replaces_the_bundled_one(render: Render) -> None:
    for scenario in (EXTERNAL_REDIS, EXTERNAL_SECRETS):
        names = render(scenario).names()
        assert not [n for n in names if "redis" in n.lower()], names


def _redis_url_of(out: Rendered, deployment: str, container: str) -> Any:
    c = _container(out.get("Deployment", deployment), container)
    # From the environment only: a password in argv would show in the pod's process list.
    assert not any("redis" in str(a).lower() for a in c["args"]), c["args"]
    return _env(c).get("KVFLEET_REDIS_URL")


@pytest.mark.parametrize(
    ("scenario", "overrides", "expected"),
    [
        (DEFAULT, [], "redis://kvfleet-router:$(KVFLEET_REDIS_PASSWORD)@kvfleet-redis:6379/0"),
        (DEFAULT, ["redis.bundled.auth.enabled=false"], "redis://kvfleet-redis:6379/0"),
        (EXTERNAL_REDIS, [], "redis://redis-master.cache.svc.cluster.local:6379/0"),
        (EXTERNAL_SECRETS, [], {"secretKeyRef": {"name": "redis-url", "key": "url"}}),
        (DEFAULT, ["redis.bundled.enabled=false"], None),
    ],
    ids=["bundled", "bundled-no-auth", "external-url", "external-secret", "none"],
)
def test_router_gets_the_redis_url(
    render: Render, scenario: str, overrides: list[str], expected: Any
) -> None:
    out = render(scenario, set=overrides)
    assert _redis_url_of(out, "kvfleet-router", "router") == expected
    router = _container(out.get("Deployment", "kvfleet-router"), "router")
    assert kvfleet_cli_params(router["args"])["redis_url"] is None


# ------------------------------------------------------------------------------------------------
# monitoring


def test_monitoring_objects_need_their_api(render: Render) -> None:
    absent = render(MONITORING)
    assert not absent.of_kind("ServiceMonitor") and not absent.of_kind("PrometheusRule")
    present = render(MONITORING, api_versions=MONITORING_APIS)
    assert len(present.of_kind("ServiceMonitor")) == 1
    assert len(present.of_kind("PrometheusRule")) == 1
    # The scrape presents the metrics token: replicas show per-tenant series only to it.
    (endpoint,) = present.of_kind("ServiceMonitor")[0]["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {
        "name": "kvfleet-auth", "key": "metrics-token"}}
    never = render(MONITORING, set=["monitoring.create=never"], api_versions=MONITORING_APIS)
    assert not never.of_kind("ServiceMonitor") and not never.of_kind("PrometheusRule")
    always = render(MONITORING, set=["monitoring.create=always"])
    assert always.of_kind("ServiceMonitor") and always.of_kind("PrometheusRule")


def test_service_monitor_scrapes_the_replicas(render: Render) -> None:
    out = render(MONITORING, api_versions=MONITORING_APIS)
    (sm,) = out.of_kind("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selector = sm["spec"]["selector"]
    svc = out.get("Service", "kvfleet-replica")
    labels = svc["metadata"]["labels"]
    assert selector["matchLabels"].items() <= labels.items()
    (expr,) = selector["matchExpressions"]
    assert expr["key"] == "app.kubernetes.io/name"
    assert set(expr["values"]) == {"kvfleet-replica", "kvfleet-router"}  # both serve /metrics
    assert labels[expr["key"]] in expr["values"]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def _rules(out: Rendered) -> list[dict[str, Any]]:
    (rule,) = out.of_kind("PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_hit_rate_alarm(render: Render) -> None:
    rules = _rules(render(MONITORING, api_versions=MONITORING_APIS))
    (alert,) = [r for r in rules if r.get("alert") == "KVFleetCacheHitRateLow"]
    assert alert["for"] == "15m"
    assert alert["expr"].rstrip().endswith("< 0.25")
    (record,) = [r for r in rules if "record" in r]
    assert alert["expr"].startswith(record["record"] + "{")
    # The replica Deployment's pods and its canary's, in this namespace only.
    assert f'namespace="{NAMESPACE}"' in record["expr"]
    assert 'pod=~"kvfleet-replica-.*"' in record["expr"]
    assert "{{ $value" in alert["annotations"]["description"]


def test_hit_rate_alarm_uses_the_metrics_the_operator_gates_on(render: Render) -> None:
    from kvfleet_operator.api import DEFAULT_HIT_RATE_QUERY

    rules = _rules(render(MONITORING, api_versions=MONITORING_APIS))
    (record,) = [r for r in rules if "record" in r]
    ours = set(re.findall(r"\bkvfleet_[a-z_]+\b", record["expr"]))
    operators = set(re.findall(r"\bkvfleet_[a-z_]+\b", DEFAULT_HIT_RATE_QUERY))
    assert ours == operators == {
        "kvfleet_cache_matched_tokens_total", "kvfleet_cache_lookup_tokens_total",
    }


def test_hit_rate_alarm_uses_metrics_the_replica_cache_exports(render: Render) -> None:
    """The names in the rule are samples the replica's cache collector really emits."""
    from kvfleet_runtime.cache import CacheStats, TenantStats
    from kvfleet_runtime.cache._metrics import _TENANT_COUNTERS, CacheCollector

    totals = TenantStats(num_blocks=1, **{attr: 1 for _, attr, _ in _TENANT_COUNTERS})
    total = CacheStats(
        tenant=None, totals=totals, tiers=(), thrashing=False, num_thrash_episodes=0,
        store_queue_len=0, num_indexed_blocks=0,
    )
    # The replica builds its PrefixCache with the default metrics prefix, "kvfleet_cache".
    collector = CacheCollector(lambda: (total, {"acme": total}), "kvfleet_cache")
    exported = {sample.name for family in collector.collect() for sample in family.samples}
    rules = _rules(render(MONITORING, api_versions=MONITORING_APIS))
    (record,) = [r for r in rules if "record" in r]
    used = set(re.findall(r"\bkvfleet_[a-z_]+\b", record["expr"]))
    assert used <= exported, f"not exported by the replica: {used - exported}"


def test_no_null_or_empty_blocks(render: Render) -> None:
    """A `with` that renders nothing must not leave `annotations:` or `env:` empty behind."""
    for scenario in (DEFAULT, EXTERNAL_SECRETS):
        for obj in render(scenario):
            text = yaml.safe_dump(obj)
            assert ": null" not in text, f"{obj['kind']}/{obj['metadata']['name']}:\n{text}"


# ------------------------------------------------------------------------------------------------
# NOTES.txt (helm renders it only on install; a copy of the chart exposes it to `helm template`)


def _notes(helm: Path, helm_env: dict[str, str], tmp_path: Path, *args: str) -> str:
    chart = tmp_path / "kvfleet"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include "kvfleet/templates/NOTES.txt" . | quote }}\n'
    )
    result = run_helm(
        helm, helm_env, "template", RELEASE, str(chart), "--namespace", NAMESPACE,
        "--kube-version", kube_version(), "--show-only", "templates/zz-notes.yaml", *args,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["data"]["notes"]


def test_notes_tell_the_next_steps(helm: Path, helm_env: dict[str, str], tmp_path: Path) -> None:
    notes = _notes(helm, helm_env, tmp_path, "--values", str(CI_VALUES / DEFAULT))
    start = notes.rindex("\n", 0, notes.index("apiVersion:")) + 1
    policy = yaml.safe_load(textwrap.dedent(notes[start:notes.index("kubectl get kvcache")]))
    assert policy["kind"] == "KVCachePolicy"
    # The policy the notes suggest selects exactly the replica pods and names the mounted ConfigMap.
    from kvfleet_operator.api import KVCachePolicySpec

    spec = KVCachePolicySpec.model_validate(policy["spec"])
    assert spec.selector.match_labels == {
        "app.kubernetes.io/name": "kvfleet-replica", "app.kubernetes.io/instance": RELEASE,
    }
    assert spec.config_map_name == "kvfleet-fleet"
    # The fields docs/quickstart.md step 5 sets are there too.
    assert spec.model.profile == "reference-70b" and spec.model.tp_degree == 4
    assert spec.tenants == [] and spec.affinity.k == 3
    with_tenants = _notes(helm, helm_env, tmp_path / "t", "--values", str(CI_VALUES / DEFAULT),
                          "--set", "router.apiKeys.tenants.globex[0]=sk-g",
                          "--set", "router.apiKeys.tenants.acme[0]=sk-a")
    assert 'tenants: ["acme","globex"]' in with_tenants
    assert "router.apiKeys.tenants is empty" in notes
    assert "no monitoring.coreos.com/v1 API" in notes


def test_notes_without_redis_warn(helm: Path, helm_env: dict[str, str], tmp_path: Path) -> None:
    notes = _notes(
        helm, helm_env, tmp_path, "--values", str(CI_VALUES / DEFAULT),
        "--set", "redis.bundled.enabled=false",
    )
    assert "no Redis is configured" in notes


def test_operator_reads_and_rolls_the_rendered_replica_template(render: Render) -> None:
    """The operator's own manifest builders on the chart's replica Deployment: it reads the
    version the chart pinned, and its canary loads the new digest's folder and is selected by the
    chart's replica Service (so it is scraped, and counted by the alarm)."""
    from kvfleet_operator.constants import DEFAULT_DIGEST_ENV
    from kvfleet_operator.manifests import canary_deployment, template_version

    out = render(DEFAULT)
    target = out.get("Deployment", "kvfleet-replica")
    template = target["spec"]["template"]
    assert template_version(template, "replica", DEFAULT_DIGEST_ENV) == (
        CI_DIGEST, "kvfleet/kvfleet-runtime:0.1.0",
    )
    canary = canary_deployment(
        target, "llama-v2", "uid-1", "replica", DEFAULT_DIGEST_ENV, DIGEST, "", 1
    )
    assert canary["metadata"]["name"].startswith("kvfleet-replica-")  # the alarm's pod regex
    c = _container(canary, "replica")
    assert _env(c)[DEFAULT_DIGEST_ENV] == DIGEST
    assert "--model-dir" in c["args"] and "/models/$(KVFLEET_WEIGHTS_DIGEST)" in c["args"]
    svc_selector = out.get("Service", "kvfleet-replica")["spec"]["selector"]
    assert svc_selector.items() <= canary["spec"]["template"]["metadata"]["labels"].items()


# ------------------------------------------------------------------------------------------------
# the operator


def _operator_rules() -> list[dict[str, Any]]:
    source = yaml.safe_load((ROOT / "operator" / "rbac" / "clusterrole.yaml").read_text())
    return source["rules"]


def test_operator_clusterrole_is_the_operators_own(render: Render) -> None:
    out = render(DEFAULT)
    role = out.get("ClusterRole", "kvfleet-operator")
    assert role["rules"] == _operator_rules()
    assert "namespace" not in role["metadata"]


def test_operator_rbac_is_least_privilege(render: Render) -> None:
    roles = render(DEFAULT).of_kind("ClusterRole") + render(DEFAULT).of_kind("Role")
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "*" not in rule["apiGroups"], rule
            assert "secrets" not in rule["resources"], "the operator never reads Secrets"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule


def _allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(
        group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
        for r in rules
    )


@pytest.mark.parametrize(
    ("group", "resource", "verb", "why"),
    [
        ("kvfleet.dev", "kvcachepolicies", "watch", "reconcile policies"),
        ("kvfleet.dev", "modelrollouts/status", "patch", "rollout status"),
        ("", "configmaps", "create", "publish the fleet ConfigMap the chart mounts"),
        ("", "configmaps", "patch", "update the fleet ConfigMap"),
        ("", "pods", "list", "home sets over the replica pods"),
        ("apps", "deployments", "create", "the canary Deployment"),
        ("apps", "deployments", "patch", "scale and re-template the chart's replica Deployment"),
        ("kopf.dev", "clusterkopfpeerings", "patch", "peering with the chart's peering object"),
        ("", "events", "create", "events on transitions"),
    ],
)
def test_operator_may_do_what_the_chart_asks_of_it(
    render: Render, group: str, resource: str, verb: str, why: str
) -> None:
    rules = render(DEFAULT).get("ClusterRole", "kvfleet-operator")["rules"]
    assert _allowed(rules, group, resource, verb), f"{verb} {group}/{resource}: {why}"


def test_operator_runs_as_its_bound_service_account(render: Render) -> None:
    out = render(DEFAULT)
    deploy = out.get("Deployment", "kvfleet-operator")
    sa = _pod_spec(deploy)["serviceAccountName"]
    assert out.get("ServiceAccount", sa)["metadata"]["namespace"] == NAMESPACE
    binding = out.get("ClusterRoleBinding", "kvfleet-operator")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kvfleet-operator",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    # Only the operator talks to the API server.
    for name in ("kvfleet-replica", "kvfleet-router", "kvfleet-redis"):
        assert _pod_spec(out.get("Deployment", name))["automountServiceAccountToken"] is False


def _operator_cli_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the operator's own command line makes of `argv` (without starting kopf)."""
    from kvfleet_operator import cli

    seen = []
    monkeypatch.setattr(cli, "_run", lambda args: seen.append(args) or 0)
    assert cli.main(argv) == 0
    return seen[0]


def test_operator_command_line_is_the_operators(
    render: Render, monkeypatch: pytest.MonkeyPatch
) -> None:
    deploy = render(DEFAULT).get("Deployment", "kvfleet-operator")
    c = _container(deploy, "operator")
    args = _operator_cli_args(c["args"], monkeypatch)
    assert args.standalone is False and args.namespace is None  # cluster-wide, peering on
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert c["image"] == "kvfleet/kvfleet-operator:0.1.0"


def test_operator_peering(render: Render, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_operator.constants import PEERING_NAME

    out = render(DEFAULT, set=["operator.replicas=2"])
    (peering,) = out.of_kind("ClusterKopfPeering")
    assert peering["apiVersion"] == "kopf.dev/v1"
    assert peering["metadata"]["name"] == PEERING_NAME
    assert out.get("Deployment", "kvfleet-operator")["spec"]["replicas"] == 2
    # The chart installs the peering CRD with the others.
    crds = render(DEFAULT, include_crds=True).of_kind("CustomResourceDefinition")
    assert "clusterkopfpeerings.kopf.dev" in {c["metadata"]["name"] for c in crds}
    standalone = render(DEFAULT, set=["operator.peering.enabled=false"])
    assert not standalone.of_kind("ClusterKopfPeering")
    c = _container(standalone.get("Deployment", "kvfleet-operator"), "operator")
    assert _operator_cli_args(c["args"], monkeypatch).standalone is True


def test_operator_replicas_without_peering_are_refused(
    helm: Path, helm_env: dict[str, str]
) -> None:
    result = run_helm(
        helm, helm_env,
        *template_args([DEFAULT], ["operator.peering.enabled=false", "operator.replicas=2"]),
    )
    assert result.returncode != 0 and "needs operator.peering.enabled" in result.stderr


def test_operator_watching_some_namespaces(
    render: Render, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = render(DEFAULT, set=["operator.watchNamespaces={llm,batch}"])
    c = _container(out.get("Deployment", "kvfleet-operator"), "operator")
    assert _operator_cli_args(c["args"], monkeypatch).namespace == ["llm", "batch"]
    # kopf peers through a KopfPeering in each watched namespace; the operator may use them.
    assert not out.of_kind("ClusterKopfPeering")
    peerings = out.of_kind("KopfPeering")
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings} == {
        ("llm", "kvfleet"), ("batch", "kvfleet"),
    }
    rules = out.get("ClusterRole", "kvfleet-operator")["rules"]
    assert _allowed(rules, "kopf.dev", "kopfpeerings", "patch")


def test_disruption_budgets_cover_replicas_and_routers(render: Render) -> None:
    out = render(DEFAULT)
    for name, field, value in (
        ("kvfleet-replica", "maxUnavailable", 1), ("kvfleet-router", "minAvailable", 1),
    ):
        pdb = out.get("PodDisruptionBudget", name)
        assert pdb["spec"][field] == value
        assert pdb["spec"]["selector"] == out.get("Deployment", name)["spec"]["selector"]
    single = render(DEFAULT, set=["router.replicas=1"])
    assert "PodDisruptionBudget/kvfleet-router" not in single.names()  # it would block drains


def test_replica_updates_one_cold_cache_at_a_time(render: Render) -> None:
    strategy = render(DEFAULT).get("Deployment", "kvfleet-replica")["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    full = render(DEFAULT, set=[
        "replica.updateStrategy.rollingUpdate.maxUnavailable=1",
        "replica.updateStrategy.rollingUpdate.maxSurge=0",
    ])
    rolling = full.get("Deployment", "kvfleet-replica")["spec"]["strategy"]["rollingUpdate"]
    assert rolling == {"maxUnavailable": 1, "maxSurge": 0}


def test_chart_packages_without_its_ci_scenarios(
    helm: Path, helm_env: dict[str, str], tmp_path: Path
) -> None:
    import tarfile

    result = run_helm(helm, helm_env, "package", str(CHART), "--destination", str(tmp_path))
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("kvfleet-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert "kvfleet/files/operator-clusterrole.yaml" in names
    assert "kvfleet/crds/kvfleet.dev_modelrollouts.yaml" in names
    assert not [n for n in names if "/ci/" in n]


def _resolved_env(container: dict[str, Any], pod: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet gives it: downward API fields from `pod`,
    Secret references as "<secret>/<key>", $(VAR) references expanded."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
        elif "fieldRef" in item["valueFrom"]:
            value = pod[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            value = f"{ref['name']}/{ref['key']}"
        env[item["name"]] = value
    return env


@pytest.mark.parametrize(
    ("scenario", "redis"),
    # A secretKeyRef resolves to "<secret>/<key>" here: the bundled Redis' password is in the URL.
    [(DEFAULT, "redis://kvfleet-replica:kvfleet-redis/replica-password@kvfleet-redis:6379/0"),
     (EXTERNAL_SECRETS, "redis-url/url")],
)
def test_replica_joins_the_fleet_tier(
    render: Render, tmp_path: Path, scenario: str, redis: str
) -> None:
    """The fleet tier's own settings loader, on the environment the chart gives a replica pod."""
    from kvfleet_runtime.fleet.fleet_tier import FleetSettings

    obj = render(scenario).get("Deployment", "kvfleet-replica")
    c = _container(obj, "replica")
    env = _resolved_env(
        c, {"metadata.name": "kvfleet-replica-7d9f-x2x4q", "status.podIP": "10.1.2.3"}
    )
    # The secret file is the mounted peer-transfer Secret's key.
    mount = _mount(c, "peer-secret")["mountPath"]
    (item,) = _volume(obj, "peer-secret")["secret"]["items"]
    assert env["KVFLEET_PEER_SECRET_FILE"] == f"{mount}/{item['path']}"
    assert env["KVFLEET_FLEET_CONFIG"] == (
        f"{_mount(c, 'fleet-config')['mountPath']}/{FLEET_CONFIG_FILENAME}"
    )
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    # The router secret is the mounted auth Secret's key; the hint key is derived from it.
    assert env["KVFLEET_ROUTER_SECRET_FILE"].startswith(_mount(c, "router-secret")["mountPath"])
    router_secret = tmp_path / "router-secret"
    router_secret.write_text("router-s3cret\n")
    settings = FleetSettings.from_env({**env, "KVFLEET_PEER_SECRET_FILE": str(token),
                                       "KVFLEET_ROUTER_SECRET_FILE": str(router_secret)},
                                      port=8000)
    assert settings is not None, "the fleet tier would be off"
    assert settings.name == "kvfleet-replica-7d9f-x2x4q"  # the pod name, as in the home sets
    assert settings.peer_url == "http://10.1.2.3:8000"
    assert settings.secret == b"s3cret"
    assert settings.redis_url == redis
    assert str(settings.fleet_config) == env["KVFLEET_FLEET_CONFIG"]
    assert settings.hint_key == hint_key(b"router-s3cret")  # block names keyed, as the router's


def test_only_the_fleet_reaches_the_bundled_redis(render: Render) -> None:
    out = render(DEFAULT)
    policy = out.get("NetworkPolicy", "kvfleet-redis")
    redis_pods = out.get("Deployment", "kvfleet-redis")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= redis_pods.items()
    (rule,) = policy["spec"]["ingress"]
    allowed = [p["podSelector"]["matchLabels"] for p in rule["from"]]
    for name in ("kvfleet-replica", "kvfleet-router"):
        pods = out.get("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert any(sel.items() <= pods.items() for sel in allowed), name
    operator = out.get("Deployment", "kvfleet-operator")["spec"]["template"]["metadata"]["labels"]
    assert not any(sel.items() <= operator.items() for sel in allowed)
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]


@pytest.mark.parametrize("component", ["operator", "router", "replica"])
def test_each_component_can_be_left_out(render: Render, component: str) -> None:
    out = render(DEFAULT, set=[f"{component}.enabled=false"])
    assert not [o for o in out if o["metadata"]["name"] == f"kvfleet-{component}"]
    others = {"operator", "router", "replica"} - {component}
    for other in others:
        assert out.get("Deployment", f"kvfleet-{other}")


def test_clusters_without_crd_validation_rules_are_refused(
    helm: Path, helm_env: dict[str, str]
) -> None:
    args = template_args([DEFAULT])
    args[args.index("--kube-version") + 1] = "v1.28.5"
    result = run_helm(helm, helm_env, *args)
    assert result.returncode != 0 and ">=1.29.0-0" in result.stderr
