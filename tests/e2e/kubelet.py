"""A test-side kubelet for kwok's fake GPU nodes: real processes behind the pods, run inside the
built runtime image.

kwok plays the kubelet of the fake nodes: it binds pods, gives them an IP from the node's
`spec.podCIDR` and marks them Running and Ready, but runs nothing. The e2e nodes get loopback pod
CIDRs (127.x.y.0/24), so every pod IP is an address this machine can bind. `KubeletShim` watches
the release's pods on those nodes and, for each running pod whose image is the kvfleet runtime
image (or the operator image, when it is given one), starts its container the way the kubelet
would, from the image scripts/images.sh built (`localhost/kvfleet/kvfleet-runtime:<version>`,
`localhost/kvfleet/kvfleet-operator:<version>`, the bytes `helm install` would pull), with
`buildah run --isolation chroot` of one working container of it (tests/images/buildah.py):

- the image: a pod's `kvfleet/kvfleet-runtime:<tag>` is the local build of that tag; a tag no
  build has is an error in `errors`, the pod is not started. One tag is a fault the tests inject,
  UNSTABLE_KEY_IMAGE: its pods run the same image, but through unstable_key.py (bind-mounted
  read-only into the container), which makes one cache-key field differ on every request (what no
  real replica can be made to do);
- the command is the container's `command` where it has one (the chart's vLLM replicas: `vllm`),
  else the image's ENTRYPOINT (its OCI config), followed by the container's `args`, with
  `$(VAR)` references expanded from the container's environment, as the kubelet does; the user
  is the pod's securityContext runAsUser:runAsGroup (the chart's 10001), the hostname the pod's
  name;
- the environment is the image's, then the container's: plain values, the downward API
  (`metadata.name`, `metadata.namespace`, `status.podIP`) and Secret/ConfigMap key references;
- each volume mount is a bind mount of a host folder at its mountPath (read-only where the pod
  says so): ConfigMap and Secret volumes are written from the live objects (and rewritten when
  they change, as the kubelet does, only faster), a hostPath is the host's folder, an emptyDir a
  fresh one (the chart's /tmp); the rest of the root filesystem is read-only
  (readOnlyRootFilesystem). buildah gives every run its own /dev/shm, so the chart's Memory
  emptyDir there is not mounted;
- a pod that does not opt out (`automountServiceAccountToken: false`; the chart's replicas and
  router do) gets what the kubelet projects: a token of its ServiceAccount from the TokenRequest
  API, bound to the pod, the cluster's CA and the namespace under
  /var/run/secrets/kubernetes.io/serviceaccount, and KUBERNETES_SERVICE_HOST/PORT naming the API
  server (on loopback), so in-cluster clients (the operator's kopf login) work as in a pod;
- the pod's own network namespace is played by its loopback address (chroot isolation shares the
  host's network): `--host 0.0.0.0` becomes `--host <pod IP>` (and `http://0.0.0.0:<port>` in
  an argument, the operator's liveness URL, `http://<pod IP>:<port>`), so every replica listens
  on its pod's IP and the container port. A vLLM replica binds two more ports: its KV-event
  publisher's `tcp://*:<port>` becomes `tcp://[::ffff:<pod IP>]:<port>` (the pod's address as
  vLLM still binds it), and the kvfleet connector's T2 server gets `kvfleet.peer_host: <pod IP>`
  in its `--kv-transfer-config`; so a rollout's canary can run beside the stable vLLM pod on the
  same ports, as on two nodes.

When a pod is deleted (or terminating) its container's process gets SIGTERM (the command itself,
not buildah's helpers, which would SIGKILL it), and the whole process group SIGKILL after a grace
period.

Readiness: kwok marks a pod Ready once, when it starts running, without probing anything. The
shim sets the pod's Ready condition to False before starting its process, then probes the
container's readinessProbe on the process every loop and writes Ready from that, as a kubelet
does; so the Deployment controller, the operator (which plans home sets and rollout steps over
Ready pods) and the tests see the real process' readiness. There is one gap: between kwok's
Ready=True and the shim's first patch (about a poll period), the pod looks Ready. A pod whose IP
a stopping pod's process still holds waits to start, and is kept not Ready meanwhile.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from kvfleet_vllm._options import PREFIX
from tests.cluster.api import STRATEGIC_MERGE, ApiClient
from tests.cluster.fixtures import Cluster
from tests.cluster.kubeconfig import current_cluster
from tests.cluster.processes import ManagedProcess, start_process
from tests.images.buildah import VERSION, Container, stop_run

# The repositories pods name (the chart's runtimeImage.repository, operator.image.repository);
# the local build of a tag is scripts/images.sh's localhost/<repository>:<version>.
RUNTIME_REPOSITORY = "kvfleet/kvfleet-runtime"
OPERATOR_REPOSITORY = "kvfleet/kvfleet-operator"
# The vLLM replica image (docker/vllm.Dockerfile, `scripts/images.sh vllm`): pods of
# `replica.engine: vllm` name it as replica.vllm.image.repository.
VLLM_REPOSITORY = "kvfleet/kvfleet-vllm"
# Where a kubelet projects a pod's ServiceAccount credentials (token, the cluster's CA, the
# namespace): what in-cluster clients (kopf's login, the kubernetes client) read.
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# The lifetime of the token the shim requests for a pod (a kubelet rotates it; the shim's pods
# live for one test or one demo).
TOKEN_DURATION_S = 24 * 3600
# The one fault the shim injects (scenario B of test_user_path.py): pods of this image run the
# real replica through tests/e2e/unstable_key.py, whose cache key never holds still.
UNSTABLE_KEY_IMAGE = f"{RUNTIME_REPOSITORY}:unstable-cache-key"
UNSTABLE_KEY_WRAPPER = Path(__file__).with_name("unstable_key.py")
# Where the wrapper's folder is mounted in the container (read-only), and how it runs there.
FAULT_MOUNT = "/opt/kvfleet-e2e"
UNSTABLE_KEY_COMMAND = ["python", f"{FAULT_MOUNT}/{UNSTABLE_KEY_WRAPPER.name}"]
# Mounts the chart makes that buildah run makes itself (its own /dev, with a /dev/shm tmpfs).
BUILDAH_MANAGED_MOUNTS = ("/dev/",)
# vLLM's flag for its KV connector's JSON config (the chart's vLLM replicas pass kvfleet's).
KV_TRANSFER_FLAG = "--kv-transfer-config"
POLL_S = 0.5
STOP_GRACE_S = 8.0
_VAR = re.compile(r"\$\((\w+)\)")


@dataclass
class LiveVolume:
    """A ConfigMap or Secret volume: its folder, its object, its items (None: every key)."""

    local: Path
    kind: str
    name: str
    items: list[tuple[str, str]] | None
    written: dict[str, bytes] = field(default_factory=dict)


@dataclass
class PodProcess:
    """One pod's container, run as a local process."""

    namespace: str
    name: str
    uid: str
    ip: str
    port: int | None
    labels: dict[str, str]
    image: str
    process: ManagedProcess
    root: Path
    live: list[LiveVolume] = field(default_factory=list)
    probe_url: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


class KubeletShim:
    """See the module docstring. `selector` picks the pods (kubectl -l), `nodes` the fake nodes
    whose pods this shim runs, `container` a working container of the built runtime image (every
    pod runs in it: the root is read-only, so nothing one pod writes reaches another);
    `operator_container`, one of the built operator image: given, the shim runs the operator pod
    too (else the operator pod is left to kwok, and the caller runs the operator itself);
    `vllm_container`, one of the built vLLM image: given, the shim runs `replica.engine: vllm`
    pods in it."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        work_dir: Path,
        *,
        selector: str,
        nodes: set[str],
        container: Container,
        operator_container: Container | None = None,
        vllm_container: Container | None = None,
        on_change: Callable[[list[PodProcess]], None] | None = None,
    ) -> None:
        self.cluster = cluster
        # Its polls go over one kept-alive connection, not a kubectl process each (api.py).
        self.api = ApiClient(cluster.kubeconfig)
        self.namespace = namespace
        self.work_dir = work_dir
        self.selector = selector
        self.nodes = nodes
        self.container = container
        self.on_change = on_change
        self.images = {RUNTIME_REPOSITORY: container}
        if operator_container is not None:
            self.images[OPERATOR_REPOSITORY] = operator_container
        if vllm_container is not None:
            self.images[VLLM_REPOSITORY] = vllm_container
        for image in self.images.values():
            if not image.entrypoint():
                raise ValueError(f"the image of {image.name} has no ENTRYPOINT")
        # The fault's wrapper, in a folder of its own that the container's user can read.
        self.fault_dir = work_dir / "fault"
        self.fault_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(UNSTABLE_KEY_WRAPPER, self.fault_dir / UNSTABLE_KEY_WRAPPER.name)
        self.fault_dir.chmod(0o755)
        (self.fault_dir / UNSTABLE_KEY_WRAPPER.name).chmod(0o644)
        self.pods: dict[str, PodProcess] = {}
        self.events: list[str] = []  # "started <pod> <ip>" / "stopped <pod>", for the report
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet-shim", daemon=True)
        self._stopping: dict[str, str] = {}  # IP -> pod whose process is still stopping
        self._stoppers: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        with self._lock:
            pods = list(self.pods.values())
        for pod in pods:
            self._stop_pod(pod)
        for thread in self._stoppers:
            thread.join(STOP_GRACE_S * 3)
        self.api.close()
        # Beside the pods' logs (kept with KVFLEET_E2E_KEEP=1): what started and stopped, when.
        (self.work_dir / "events.log").write_text("\n".join([*self.events, *self.errors]) + "\n")

    def running(self, label: str | None = None) -> list[PodProcess]:
        """Pods with a live process; `label` 'key=value' filters them."""
        with self._lock:
            pods = [p for p in self.pods.values() if p.process.alive()]
        if label is not None:
            key, _, value = label.partition("=")
            pods = [p for p in pods if p.labels.get(key) == value]
        return sorted(pods, key=lambda p: p.name)

    # -- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except (ValueError, KeyError, OSError) as exc:
                self.errors.append(f"{time.strftime('%H:%M:%S')} {exc!r}"[:500])
            self._stop.wait(POLL_S)

    def _list(self, kind: str, resource: str, **query: str) -> list[dict[str, Any]]:
        """The namespace's objects of one kind, each with its `kind` (a list's items have none)."""
        items: list[dict[str, Any]] = self.api.get(
            f"/api/v1/namespaces/{self.namespace}/{resource}", **query)["items"]
        for item in items:
            item["kind"] = kind
        return items

    def _sync(self) -> None:
        pods = self._list("Pod", "pods", labelSelector=self.selector)
        # Helm's release records (the whole chart, gzipped, per revision) are no pod's volume.
        objects = {(o["kind"], o["metadata"]["name"]): o for o in [
            *self._list("ConfigMap", "configmaps"),
            *self._list("Secret", "secrets", fieldSelector="type!=helm.sh/release.v1")]}
        wanted: dict[str, dict[str, Any]] = {}
        for pod in pods:
            meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
            if (
                spec.get("nodeName") in self.nodes
                and status.get("phase") == "Running"
                and status.get("podIP")
                and not meta.get("deletionTimestamp")
                and spec["containers"][0]["image"].rpartition(":")[0] in self.images
            ):
                wanted[meta["uid"]] = pod
        changed = False
        with self._lock:
            current = {p.uid: p for p in self.pods.values()}
        for uid, record in current.items():
            if uid not in wanted:
                self._stop_pod(record)
                changed = True
        for uid, pod in wanted.items():
            existing = current.get(uid)
            if existing is not None:
                self._refresh(existing.live, objects)
                self._report_readiness(existing, pod)
            elif pod["status"]["podIP"] not in self._stopping:
                # kwok may hand a deleted pod's IP to a new pod at once: start it only once the
                # old process has let go of the address.
                self._set_ready(pod["metadata"]["name"], False)
                self._start_pod(pod, objects)
                changed = True
            elif _ready(pod):
                # Waiting for the address, nothing runs yet: not Ready, whatever kwok said (else
                # the Deployment counts it ready for the old process' whole grace period).
                self._set_ready(pod["metadata"]["name"], False)
        if changed and self.on_change is not None:
            self.on_change(self.running())

    def _stop_pod(self, pod: PodProcess) -> None:
        """SIGTERM now, SIGKILL after the grace period, in the background (the loop goes on)."""
        with self._lock:
            self.pods.pop(pod.name, None)
            self._stopping[pod.ip] = pod.name

        def stop() -> None:
            try:
                stop_run(pod.process.popen, STOP_GRACE_S)
            finally:
                with self._lock:
                    self._stopping.pop(pod.ip, None)
                self.events.append(f"{time.strftime('%H:%M:%S')} stopped {pod.name} "
                                   f"rc={pod.process.popen.returncode}")

        thread = threading.Thread(target=stop, name=f"stop-{pod.name}", daemon=True)
        thread.start()
        self._stoppers.append(thread)

    # -- readiness: the real process' probe, not kwok's say-so -----------------------------

    def _report_readiness(self, record: PodProcess, pod: dict[str, Any]) -> None:
        """Probe the container's readinessProbe (httpGet) on the process and write the pod's
        Ready condition when it differs, as the kubelet does. kwok sets Ready=True once, when
        the pod starts running, and never again, so after that the condition is ours."""
        ready = record.probe_url is None or http_json(record.probe_url, timeout_s=2)[0] == 200
        if not record.process.alive():
            ready = False
        if ready != _ready(pod):
            self._set_ready(record.name, ready)
            self.events.append(f"{time.strftime('%H:%M:%S')} {record.name} ready={ready}")

    def _set_ready(self, name: str, ready: bool) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        value = "True" if ready else "False"
        patch = {"status": {"conditions": [
            {"type": kind, "status": value, "lastTransitionTime": now}
            for kind in ("Ready", "ContainersReady")
        ]}}
        self.api.patch(f"/api/v1/namespaces/{self.namespace}/pods/{name}/status", patch,
                       STRATEGIC_MERGE)

    # -- the pod's container ---------------------------------------------------------------

    def _start_pod(self, pod: dict[str, Any], objects: dict[tuple[str, str], Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        (container,) = spec["containers"]
        ip = pod["status"]["podIP"]
        repository, _, tag = container["image"].rpartition(":")
        image = self.images[repository]
        fault = container["image"] == UNSTABLE_KEY_IMAGE
        if fault:
            entrypoint = UNSTABLE_KEY_COMMAND
        elif tag == VERSION:
            entrypoint = image.entrypoint()
        else:
            raise ValueError(f"pod {meta['name']}: no local build of {container['image']} "
                             f"(scripts/images.sh builds {repository}:{VERSION})")
        root = self.work_dir / meta["name"]
        root.mkdir(parents=True, exist_ok=True)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        binds: list[str] = []
        live: list[LiveVolume] = []
        automount = spec.get("automountServiceAccountToken", True)
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"].startswith(BUILDAH_MANAGED_MOUNTS):
                continue
            target = mount["mountPath"]
            if target == SERVICE_ACCOUNT_MOUNT:
                # The API server's ServiceAccount admission put its projected volume here.
                local = self._service_account(pod, root)
                target = in_image(image.mount, target)
                automount = False
            else:
                local = self._volume_dir(volumes[mount["name"]], root, objects, live)
            mode = ":ro" if mount.get("readOnly") else ""
            binds.append(f"{local / mount.get('subPath', '')}:{target}{mode}")
        if fault:
            binds.append(f"{self.fault_dir}:{FAULT_MOUNT}:ro")
        # The kubelet's service environment (every pod has it), and the projected credentials
        # where the pod has no volume for them (an API server without ServiceAccount admission)
        # and does not opt out.
        env = self._service_env()
        if automount:
            target = in_image(image.mount, SERVICE_ACCOUNT_MOUNT)
            binds.append(f"{self._service_account(pod, root)}:{target}:ro")

        fields = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "status.podIP": ip,
        }
        # The image's variables (PATH, HOME=/tmp) come from its config through buildah, and
        # HOSTNAME from --hostname; these are the pod's.
        for item in container.get("env", []):
            if "value" in item:
                value = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), item["value"])
            else:
                source = item["valueFrom"]
                if "fieldRef" in source:
                    value = fields[source["fieldRef"]["fieldPath"]]
                else:
                    kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
                    ref = source.get("secretKeyRef") or source["configMapKeyRef"]
                    value = _object_data(objects[(kind, ref["name"])])[ref["key"]].decode()
            env[item["name"]] = value
        args = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a)
                for a in container.get("args", [])]
        if "command" in container and not fault:
            # The kubelet's rule: a container's command replaces the image's ENTRYPOINT.
            entrypoint = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a)
                          for a in container["command"]]
        # The pod's network namespace: its own address instead of every address (`--host
        # 0.0.0.0`, the operator's `--liveness http://0.0.0.0:<port>/healthz`).
        args = [ip if a == "0.0.0.0" and i and args[i - 1] == "--host" else a
                for i, a in enumerate(args)]
        args = [a.replace("//0.0.0.0:", f"//{ip}:") for a in args]
        # The same for what a vLLM replica binds beside its API: vLLM's KV-event publisher
        # (ZMQ's every address, `tcp://*:<port>`) and the connector's T2 server (every address
        # unless `kvfleet.peer_host` says otherwise). On one host, two pods binding every address
        # on the same port would be one pod too many (a rollout's canary beside the stable).
        # The publisher's address is written IPv4-mapped: vLLM binds an endpoint with `*` or
        # `::` in it and connects to any other, and ZMQ binds `[::ffff:<ip>]` as <ip>.
        args = [a.replace("tcp://*:", f"tcp://[::ffff:{ip}]:") for a in args]
        args = [_connector_on(a, ip) if i and args[i - 1] == KV_TRANSFER_FLAG else a
                for i, a in enumerate(args)]
        ports = [p["containerPort"] for p in container.get("ports", [])]
        argv = image.argv([*entrypoint, *args], volumes=binds, env=env,
                          user=_run_as(spec, container), hostname=meta["name"])
        process = start_process(meta["name"], argv, self.work_dir)
        record = PodProcess(meta["namespace"], meta["name"], meta["uid"], ip,
                            ports[0] if ports else None, dict(meta.get("labels") or {}),
                            container["image"], process, root, live)
        probe = (container.get("readinessProbe") or {}).get("httpGet")
        if probe is not None:
            named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            port = named.get(probe["port"], probe["port"])
            record.probe_url = f"http://{ip}:{port}{probe.get('path', '/')}"
        with self._lock:
            self.pods[meta["name"]] = record
        self.events.append(f"{time.strftime('%H:%M:%S')} started {meta['name']} {ip}")

    def _service_account(self, pod: dict[str, Any], root: Path) -> Path:
        """The pod's projected ServiceAccount volume: a token from the TokenRequest API bound to
        the pod (as the kubelet requests it: it dies with the pod), the cluster's CA and the
        namespace, readable by the container's user."""
        meta, spec = pod["metadata"], pod["spec"]
        account = spec.get("serviceAccountName") or "default"
        token = str(self.api.post(
            f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": TOKEN_DURATION_S,
                      "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                         "uid": meta["uid"]}}},
        )["status"]["token"])
        entry = current_cluster(self.cluster.kubeconfig)
        if "certificate-authority-data" in entry:
            ca = base64.b64decode(entry["certificate-authority-data"])
        else:
            ca = Path(entry["certificate-authority"]).read_bytes()
        local = root / "volumes" / "kube-api-access"
        local.mkdir(parents=True, exist_ok=True)
        local.chmod(0o755)
        for name, content in (("token", token.encode()), ("ca.crt", ca),
                              ("namespace", meta["namespace"].encode())):
            (local / name).write_bytes(content)
            (local / name).chmod(0o644)
        return local

    def _service_env(self) -> dict[str, str]:
        """KUBERNETES_SERVICE_HOST/PORT: the `kubernetes` Service as the kubelet tells every pod
        of it; here the API server itself, on loopback (the pods share the host's network)."""
        url = urllib.parse.urlsplit(self.cluster.api_url)
        port = str(url.port or 443)
        return {"KUBERNETES_SERVICE_HOST": url.hostname or "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": port, "KUBERNETES_SERVICE_PORT_HTTPS": port}

    def _volume_dir(
        self, volume: dict[str, Any], root: Path, objects: dict[tuple[str, str], Any],
        live: list[LiveVolume],
    ) -> Path:
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        local = root / "volumes" / str(volume["name"])
        local.mkdir(parents=True, exist_ok=True)
        # The kubelet's modes: an emptyDir is world-writable, a ConfigMap or Secret volume
        # readable by the container's user (defaultMode 0644, the chart sets none).
        local.chmod(0o777 if "emptyDir" in volume else 0o755)
        for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
            if key in volume:
                source = volume[key]
                items = source.get("items")
                live.append(LiveVolume(
                    local, kind, source.get("name") or source["secretName"],
                    None if not items else [(i["key"], i["path"]) for i in items],
                ))
        self._refresh(live, objects)
        return local

    @staticmethod
    def _refresh(live: list[LiveVolume], objects: dict[tuple[str, str], Any]) -> None:
        """Write each ConfigMap/Secret volume's files from the live objects, when they changed.
        A missing object (an optional volume) leaves the folder empty until it appears."""
        for volume in live:
            obj = objects.get((volume.kind, volume.name))
            if obj is None:
                continue
            data = _object_data(obj)
            pairs = volume.items if volume.items is not None else [(k, k) for k in data]
            for key, path in pairs:
                content = data.get(key)
                target = volume.local / path
                if content is None or volume.written.get(path) == content:
                    continue
                tmp = target.with_name(target.name + ".tmp")
                tmp.write_bytes(content)
                tmp.chmod(0o644)
                tmp.replace(target)  # atomic, as the kubelet's symlink swap
                volume.written[path] = content


def in_image(root: Path, path: str) -> str:
    """`path` with the image's own symlinks resolved (Debian's /var/run -> /run): buildah's chroot
    mounts, and the mount point made for them on the working container's filesystem, would follow
    an absolute link on the host (onto the host's /run) instead of inside the image."""
    resolved = PurePosixPath("/")
    for part in PurePosixPath(path).parts[1:]:
        host = root / str(resolved / part).lstrip("/")
        if host.is_symlink():
            link = PurePosixPath(os.readlink(host))
            resolved = PurePosixPath(os.path.normpath(link if link.is_absolute()
                                                      else resolved / link))
        else:
            resolved = resolved / part
    return str(resolved)


def _connector_on(config: str, ip: str) -> str:
    """A `--kv-transfer-config` whose kvfleet connector serves T2 on the pod's address: its
    `kvfleet.peer_host` set to `ip` where the config serves T2 on every address."""
    doc = json.loads(config)
    extra = doc.get("kv_connector_extra_config") or {}
    if f"{PREFIX}peer_port" in extra and extra.get(f"{PREFIX}peer_host", "0.0.0.0") == "0.0.0.0":
        extra[f"{PREFIX}peer_host"] = ip
    return json.dumps(doc)


def _run_as(spec: dict[str, Any], container: dict[str, Any]) -> str | None:
    """`uid:gid` from the securityContext (the container's wins over the pod's); None: the
    image's USER."""
    pod_context = spec.get("securityContext") or {}
    context = {**pod_context, **(container.get("securityContext") or {})}
    if "runAsUser" not in context:
        return None
    return f"{context['runAsUser']}:{context.get('runAsGroup', 0)}"


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _object_data(obj: dict[str, Any]) -> dict[str, bytes]:
    if obj["kind"] == "Secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    return {k: v.encode() for k, v in (obj.get("data") or {}).items()}


def http_json(url: str, body: Any = None, headers: dict[str, str] | None = None,
              timeout_s: float = 10.0) -> tuple[int, Any]:
    """(status, parsed JSON body or text); status 0 when nothing answered."""
    status, _headers, parsed = http_json_headers(url, body, headers, timeout_s)
    return status, parsed


def http_json_headers(url: str, body: Any = None, headers: dict[str, str] | None = None,
                      timeout_s: float = 10.0) -> tuple[int, dict[str, str], Any]:
    """(status, response headers, parsed JSON body or text); status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            raw, status, got = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    except OSError:
        return 0, {}, None
    try:
        return status, got, json.loads(raw)
    except ValueError:
        return status, got, raw.decode(errors="replace")
