"""Real replica processes behind the test cluster's pods, and a real Prometheus scraping them.

The cluster's pods are kwok's: Running and Ready, but nothing runs in them. `ReplicaFarm` gives
each Running pod of the watched Deployments a real `kvfleet replica` process on loopback (the tiny
reference model on CPU), loading the checkpoint whose weights digest the pod's template carries
(`kvfleet.dev/weights-digest`; the replica refuses any other through KVFLEET_WEIGHTS_DIGEST). It
stops a process when its pod goes away, sends every process a steady stream of completions whose
prompts start with one of a few tenants' system prompts, and writes the Prometheus file_sd targets
with the `namespace` and `pod` labels kubernetes_sd would give them. Prometheus then scrapes each
replica's own `/metrics` (`kvfleet_cache_lookup_tokens_total`,
`kvfleet_cache_matched_tokens_total`).

A namespace can be marked `broken`: its canary pods' replicas then run with a cache too small to
hold a system prompt, so their hit rate never recovers (the rollback case).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import credentials
from tests.support import free_port

TENANTS = ("acme", "globex", "initech")
_SYSTEM_WORDS = "you are a careful assistant for {t}; answer briefly and cite the policy. "




def _get(url: str, timeout_s: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        data: bytes = r.read()
    return data


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping the file_sd targets every second."""

    def __init__(self, work_dir: Path) -> None:
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        self.targets = work_dir / "targets.json"
        self.targets.write_text("[]", encoding="utf-8")
        config = work_dir / "prometheus.yml"
        scrape = {
            "job_name": "replicas",
            "scrape_interval": "1s",
            "scrape_timeout": "1s",
            "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}],
            # Per-tenant series only for the scrape token (docs/security.md).
            "authorization": credentials.SCRAPE_AUTHORIZATION,
        }
        config.write_text(
            json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [scrape]}),
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
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get(f"{self.url}/-/ready", 1):
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start; see {self.log.name}")
            time.sleep(0.2)

    def write_targets(self, targets: list[tuple[str, str, int]]) -> None:
        """(namespace, pod, port) of every replica to scrape."""
        groups = [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": ns, "pod": pod}}
            for ns, pod, port in sorted(targets)
        ]
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups), encoding="utf-8")
        tmp.replace(self.targets)

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        result: list[dict[str, Any]] = json.loads(_get(url, 5))["data"]["result"]
        return result

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@dataclass
class _Replica:
    namespace: str
    pod: str
    port: int
    proc: subprocess.Popen[bytes]
    ready: bool = False
    num_requests: int = 0


@dataclass
class ReplicaFarm:
    """See the module docstring. `list_pods()` returns the cluster's pods (kubectl JSON items)."""

    work_dir: Path
    list_pods: Callable[[], list[dict[str, Any]]]
    prometheus: Prometheus
    models: dict[str, Path] = field(default_factory=dict)  # weights digest -> checkpoint
    broken: set[str] = field(default_factory=set)  # namespaces whose canaries never recover
    replicas: dict[tuple[str, str], _Replica] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def generate_models(self) -> tuple[str, str]:
        """Two tiny checkpoints (different seeds): the old and the new weights."""
        digests = []
        for seed in (0, 1):
            out = self.work_dir / f"model-{seed}"
            cli = Path(sys.executable).with_name("kvfleet")
            line = subprocess.run(
                [str(cli), "model", "generate", "--out", str(out), "--seed", str(seed)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            digest = next(w for w in line if w.startswith("sha256:"))
            self.models[digest] = out
            digests.append(digest)
        return digests[0], digests[1]

    def start(self) -> None:
        threading.Thread(target=self._follow, daemon=True).start()
        threading.Thread(target=self._load, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        for replica in list(self.replicas.values()):
            self._terminate(replica)

    # -- pods <-> processes ----------------------------------------------------------------

    def _spawn(self, namespace: str, pod: dict[str, Any]) -> _Replica | None:
        name = pod["metadata"]["name"]
        annotations = pod["metadata"].get("annotations") or {}
        digest = annotations.get("kvfleet.dev/weights-digest", "")
        model = self.models.get(digest)
        if model is None:
            self.errors.append(f"{namespace}/{name}: no checkpoint for digest {digest!r}")
            return None
        port = free_port()
        env = {**os.environ, **credentials.ENV}
        env.update(
            KVFLEET_WEIGHTS_DIGEST=digest,
            KVFLEET_REPLICA_CPU_THREADS="1",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
        )
        if namespace in self.broken and "-canary-" in name:
            # A cache that cannot hold one system prompt: its hit rate never recovers. T0 is the
            # engine's own KV (sized by engine.num_kv_blocks), so T0 is off and the one-block T1
            # is the whole cache.
            env.update(
                KVFLEET_REPLICA_CACHE__T0_ENABLED="false", KVFLEET_REPLICA_CACHE__NUM_T1_BLOCKS="1"
            )
        log = (self.work_dir / f"{namespace}.{name}.log").open("wb")
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("kvfleet")),
                "replica",
                "--model-dir",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
                "--model-id",
                "llm",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        return _Replica(namespace, name, port, proc)

    @staticmethod
    def _terminate(replica: _Replica) -> None:
        if replica.proc.poll() is None:
            replica.proc.terminate()
            try:
                replica.proc.wait(10)
            except subprocess.TimeoutExpired:
                replica.proc.kill()

    def _follow(self) -> None:
        while not self.stop.is_set():
            try:
                pods = self.list_pods()
            except Exception as exc:  # keep following through API hiccups
                self.errors.append(f"list pods: {exc}")
                pods = []
            live = {}
            for pod in pods:
                meta = pod["metadata"]
                if pod.get("status", {}).get("phase") != "Running" or meta.get("deletionTimestamp"):
                    continue
                live[(meta["namespace"], meta["name"])] = pod
            for key in list(self.replicas):
                if key not in live:
                    self._terminate(self.replicas.pop(key))
            for key, pod in live.items():
                if key not in self.replicas:
                    replica = self._spawn(key[0], pod)
                    if replica is not None:
                        self.replicas[key] = replica
            for replica in self.replicas.values():
                if replica.proc.poll() is not None and not replica.ready:
                    self.errors.append(
                        f"{replica.namespace}/{replica.pod}: exited {replica.proc.returncode}"
                    )
                if not replica.ready:
                    with contextlib.suppress(OSError):
                        replica.ready = b'"ready"' in _get(
                            f"http://127.0.0.1:{replica.port}/readyz", 1
                        )
            self.prometheus.write_targets(
                [(r.namespace, r.pod, r.port) for r in self.replicas.values() if r.ready]
            )
            self.stop.wait(1.0)

    # -- traffic -----------------------------------------------------------------------------

    def _load(self) -> None:
        i = 0
        while not self.stop.is_set():
            for replica in [r for r in list(self.replicas.values()) if r.ready]:
                tenant = TENANTS[i % len(TENANTS)]
                prompt = _SYSTEM_WORDS.format(t=tenant) * 8 + f"question {i}"
                body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
                url = f"http://127.0.0.1:{replica.port}/v1/completions"
                request = urllib.request.Request(
                    url,
                    data=body,
                    # The farm plays the router: its tenant requests carry the router's assertion.
                    headers={"Content-Type": "application/json",
                             **credentials.as_router(tenant, url)},
                )
                try:
                    with urllib.request.urlopen(request, timeout=5) as r:
                        r.read()
                    replica.num_requests += 1
                except OSError:
                    pass
                i += 1
            self.stop.wait(0.1)
