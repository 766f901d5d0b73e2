"""A local fleet of real processes: `kvfleet replica` x n and `kvfleet router`, on 127.0.0.1.

Every child runs in its own session (so its own process group): a Ctrl-C on the terminal reaches
only the demo, which then stops each group (SIGTERM, then SIGKILL after a grace period). `stop` is
idempotent and runs from `__exit__`, so errors, Ctrl-C and SIGTERM (turned into KeyboardInterrupt
by the CLI) all end with no child left.

The replicas get the fleet tier's environment (name, peer secret, peer URL, and a fleet config
file `fleet.yaml` listing every replica's name and URL; `KVFLEET_REDIS_URL` only when a Redis URL
is given), so they serve the load report the router polls for occupancy and spill decisions, and
find each other's blocks over T2 either way. Without Redis their hint index is the peer probe
(`kvfleet_runtime.fleet.probe`): a replica that misses a prefix asks the other replicas on
loopback how much of it they hold, then fetches the longest run over T2. With Redis the replicas
publish hints there instead, and the router's cache-aware override is on too (the router reads
hints only from Redis; without it routing is plain tenant affinity with spill).

The cache is toggled live through each replica's watched config file (`cache.enabled`), so the
cache-off baseline and the cached run use the same processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvfleet_lab.processes import free_port

__all__ = ["FleetError", "FleetOptions", "LocalFleet", "ensure_model"]

_CLI = [sys.executable, "-m", "kvfleet_runtime.cli"]
_STOP_GRACE_S = 5.0


class FleetError(RuntimeError):
    """A child failed to start or died; the message carries the tail of its log."""


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    # Inherited KVFLEET_* settings would silently change the fleet under test.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    env.update(extra)
    return env


def ensure_model(cache_dir: Path, preset: str, seed: int, log: Path) -> Path:
    """A `kvfleet model generate` checkpoint under `cache_dir` (else the temp dir), generated
    once and reused."""
    # "-v2": its config.json declares the byte tokenizer; a folder generated before lacks that
    # and would be refused.
    out = cache_dir / f"{preset}-seed{seed}-v2"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable cache (a read-only home): generate into the temp dir instead
        fallback = Path(tempfile.gettempdir()) / "kvfleet-demo-models"
        if fallback == cache_dir:
            raise
        return ensure_model(fallback, preset, seed, log)
    tmp = cache_dir / f".{out.name}.{os.getpid()}.tmp"
    cmd = [*_CLI, "model", "generate", "--out", str(tmp), "--preset", preset, "--seed", str(seed)]
    with log.open("ab") as sink:
        result = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=_child_env({}),
                                timeout=600)
    if result.returncode != 0:
        raise FleetError(f"kvfleet model generate failed (exit {result.returncode}); see {log}")
    try:
        tmp.rename(out)
    except OSError:  # another demo generated it meanwhile: same preset and seed, same bytes
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return out


@dataclass(slots=True)
class FleetOptions:
    model_dir: Path
    work_dir: Path
    """Configs, keys and logs go here."""
    tenants: tuple[str, ...]
    num_replicas: int = 3
    redis_url: str | None = None
    redis_cluster_urls: tuple[str, ...] = ()
    """Seed URLs of a Redis Cluster hint index (wins over `redis_url`, as in a pod)."""
    router_redis_urls: tuple[str, ...] = ()
    """The router's own URL(s) of the same Redis (another ACL user: `hint_index.ACL_USERS`);
    default the replicas'. Passed in the environment: a password never goes on argv."""
    hint_lookup_budget_s: float | None = None
    """`KVFLEET_HINT_LOOKUP_BUDGET_S` of every process; None: the default (2 ms with Redis, a
    quiet pod's figure: on a loaded box most lookups would miss it)."""
    peer_urls: dict[str, str] = field(default_factory=dict)
    """Replica name -> the URL its peers reach it at (fleet config and `KVFLEET_PEER_URL`);
    default its own. The soak puts a fault-injecting proxy there."""
    num_kv_blocks: int = 512
    num_t1_blocks: int = 1024
    max_prompt_tokens: int = 4000
    cpu_threads: int = 1
    recompute_s_per_token: float = 1e-3
    """For the router's cache-aware override (only with an index the router can read)."""
    start_timeout_s: float = 180.0
    metrics_token: str = ""
    """The replicas' metrics token (per-tenant series only for scrapes that present it); none:
    the replicas show the per-tenant series to nobody (they have a router secret)."""
    nvme_capacity_bytes: int = 0
    """> 0: each replica gets a T3 file of this size in `work_dir`, and the fleet config turns
    T3 on (`tiers.nvme`)."""
    t2_nixl: bool = True
    """T2's bytes over NIXL where it is installed (`KVFLEET_T2_NIXL`); False: over HTTP only."""


@dataclass(slots=True)
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    cmd: list[str]
    env: dict[str, str]


@dataclass
class LocalFleet:
    options: FleetOptions
    api_keys: dict[str, str] = field(default_factory=dict)
    """tenant -> API key."""
    router_url: str = ""
    replica_urls: dict[str, str] = field(default_factory=dict)
    _children: list[_Child] = field(default_factory=list)
    _configs: dict[str, Path] = field(default_factory=dict)
    _ports: dict[str, int] = field(default_factory=dict)
    _operator_token: str = ""
    router_secret: str = ""
    """The secret the router signs tenant assertions with (the replicas verify them)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children]

    @property
    def pid_by_name(self) -> dict[str, int]:
        """Each child's pid by name ("router", "r0", ...), restarted children included."""
        return {c.name: c.proc.pid for c in self._children}

    def config_path(self, name: str) -> Path:
        """Replica `name`'s watched config file."""
        return self._configs[name]

    def kill(self, name: str) -> None:
        """SIGKILL child `name`'s process group (a crash: no graceful drain)."""
        child = self._child(name)
        _signal_group(child.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=10.0)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start child `name` again (same command, port and config) and wait until ready."""
        child = self._child(name)
        if child.proc.poll() is None:
            self.kill(name)
        self._children.remove(child)
        self._spawn(name, child.cmd, child.env, child.log, child.url, append=True)
        self._wait_ready(self._child(name), time.monotonic() + timeout_s)

    def _child(self, name: str) -> _Child:
        for child in self._children:
            if child.name == name:
                return child
        raise KeyError(name)

    def start(self, *, cache_enabled: bool) -> None:
        """Start the replicas and the router and wait until all are ready."""
        opts = self.options
        opts.work_dir.mkdir(parents=True, exist_ok=True)
        logs = opts.work_dir / "logs"
        logs.mkdir(exist_ok=True)
        secret = secrets.token_hex(16)
        # The router's tenant assertions and the operator's token, as the chart generates them:
        # the demo's tenants are real tenants, so the replicas must know the router.
        router_secret = self.router_secret = secrets.token_hex(16)
        self._operator_token = secrets.token_hex(16)
        names = [f"r{i}" for i in range(opts.num_replicas)]
        for name in names:
            self._ports[name] = free_port()
        # The replica list: each replica's peer names resolve to URLs through it, and without
        # Redis it is whom the peer-probe hint index asks.
        fleet_config = opts.work_dir / "fleet.yaml"
        peer_urls = {n: opts.peer_urls.get(n, f"http://127.0.0.1:{self._ports[n]}")
                     for n in names}
        published: dict[str, Any] = {"replicas": [
            {"name": n, "url": peer_urls[n]} for n in names
        ]}
        if opts.nvme_capacity_bytes:
            published["tiers"] = {"nvme": True}
        fleet_config.write_text(json.dumps(published, indent=1))
        for name in names:
            port = self._ports[name]
            self._configs[name] = opts.work_dir / f"{name}.yaml"
            self._write_config(name, cache_enabled=cache_enabled)
            env = {
                "KVFLEET_FLEET_NAME": name,
                "KVFLEET_PEER_SECRET": secret,
                "KVFLEET_PEER_URL": peer_urls[name],
                "KVFLEET_FLEET_CONFIG": str(fleet_config),
                "KVFLEET_ROUTER_SECRET": router_secret,
                "KVFLEET_OPERATOR_TOKEN": self._operator_token,
            }
            if opts.redis_url:
                env["KVFLEET_REDIS_URL"] = opts.redis_url
            if opts.redis_cluster_urls:
                env["KVFLEET_REDIS_CLUSTER_URLS"] = ",".join(opts.redis_cluster_urls)
            if opts.hint_lookup_budget_s is not None:
                env["KVFLEET_HINT_LOOKUP_BUDGET_S"] = str(opts.hint_lookup_budget_s)
            if opts.metrics_token:
                env["KVFLEET_METRICS_TOKEN"] = opts.metrics_token
            env["KVFLEET_T2_NIXL"] = "1" if opts.t2_nixl else "0"
            cmd = [*_CLI, "replica", "--config", str(self._configs[name]),
                   "--log-level", "WARNING"]
            self._spawn(name, cmd, env, logs / f"{name}.log", f"http://127.0.0.1:{port}")
            self.replica_urls[name] = f"http://127.0.0.1:{port}"
        keys_path = opts.work_dir / "keys.json"
        self.api_keys = {t: f"sk-demo-{t}-{secrets.token_hex(4)}" for t in opts.tenants}
        keys_path.write_text(json.dumps({"tenants": {t: [k] for t, k in self.api_keys.items()}}))
        port = free_port()
        cmd = [*_CLI, "router", "--keys", str(keys_path), "--port", str(port),
               "--poll-interval-s", "0.25", "--log-level", "WARNING"]
        for name, url in self.replica_urls.items():
            cmd += ["--replica", f"{name}={url}"]
        router_env = {"KVFLEET_ROUTER_SECRET": router_secret}
        if opts.hint_lookup_budget_s is not None:
            router_env["KVFLEET_HINT_LOOKUP_BUDGET_S"] = str(opts.hint_lookup_budget_s)
        if opts.redis_cluster_urls:
            router_env["KVFLEET_REDIS_CLUSTER_URLS"] = ",".join(
                opts.router_redis_urls or opts.redis_cluster_urls)
        elif opts.redis_url:
            router_env["KVFLEET_REDIS_URL"] = (opts.router_redis_urls or (opts.redis_url,))[0]
        if opts.redis_url or opts.redis_cluster_urls:
            cmd += ["--recompute-s-per-token", str(opts.recompute_s_per_token)]
        self.router_url = f"http://127.0.0.1:{port}"
        self._spawn("router", cmd, router_env, logs / "router.log", self.router_url)
        deadline = time.monotonic() + opts.start_timeout_s
        for child in self._children:
            self._wait_ready(child, deadline)
        # Every replica must be in the router's view before traffic starts.
        self._wait_until(
            deadline,
            lambda: len(self._get_json(f"{self.router_url}/readyz").get("ready_replicas", []))
            == opts.num_replicas,
            "the router to see every replica",
        )

    def set_cache(self, enabled: bool, timeout_s: float = 30.0) -> None:
        """Turn every replica's cache on or off (live config reload) and wait until applied."""
        for name in self._configs:
            self._write_config(name, cache_enabled=enabled)
        deadline = time.monotonic() + timeout_s
        for name, url in self.replica_urls.items():
            self._wait_until(
                deadline,
                lambda url=url: self._get_json(
                    f"{url}/cache/stats", self._operator_token).get("enabled") is enabled,
                f"replica {name} to apply cache.enabled={enabled}",
            )

    def t2_counters(self) -> dict[str, dict[str, Any]]:
        """Each replica's T2 counters so far (its load report's `t2`: fetch outcomes, blocks
        and bytes fetched from peers); {} for a replica that does not answer."""
        out: dict[str, dict[str, Any]] = {}
        for name, url in self.replica_urls.items():
            t2 = self._get_json(f"{url}/fleet/v1/load").get("t2")
            out[name] = t2 if isinstance(t2, dict) else {}
        return out

    def stop(self) -> None:
        """Stop every child's process group: SIGTERM, then SIGKILL after a grace period."""
        if not self._children:
            return
        previous = signal.getsignal(signal.SIGINT)
        in_main = _in_main_thread()
        if in_main:  # a second Ctrl-C must not interrupt the cleanup itself
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for child in self._children:
                _signal_group(child.proc, signal.SIGTERM)
            deadline = time.monotonic() + _STOP_GRACE_S
            for child in self._children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            for child in self._children:
                _signal_group(child.proc, signal.SIGKILL)  # stragglers and grandchildren
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=5.0)
            self._children.clear()
        finally:
            if in_main:
                signal.signal(signal.SIGINT, previous)

    # -- internals ---------------------------------------------------------------------------

    def _write_config(self, name: str, *, cache_enabled: bool) -> None:
        opts = self.options
        config: dict[str, Any] = {
            "model_dir": str(opts.model_dir),
            "model_id": "kvfleet-demo",
            "host": "127.0.0.1",
            "port": self._ports[name],
            "device": "cpu",
            "cpu_threads": opts.cpu_threads,
            "config_poll_interval_s": 0.2,
            "limits": {"max_prompt_tokens": opts.max_prompt_tokens, "max_tokens": 64,
                       "max_body_bytes": 4 << 20},
            "engine": {"num_kv_blocks": opts.num_kv_blocks, "max_batch_size": 16,
                       "max_waiting": 256, "max_tokens_per_step": 2048},
            "cache": {"enabled": cache_enabled, "t0_enabled": True,
                      "num_t1_blocks": opts.num_t1_blocks},
        }
        if opts.nvme_capacity_bytes:
            t3_dir = opts.work_dir / f"{name}-t3"  # T3 preallocates its one file in here
            t3_dir.mkdir(exist_ok=True)
            config["cache"].update(nvme_path=str(t3_dir),
                                   nvme_capacity_bytes=opts.nvme_capacity_bytes)
        path = self._configs[name]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config, indent=1))
        tmp.replace(path)  # atomic: the watcher never reads half a file

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], log: Path, url: str,
               *, append: bool = False) -> None:
        with log.open("ab" if append else "wb") as sink:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                env=_child_env(env), start_new_session=True,
            )
        self._children.append(_Child(name, proc, log, url, cmd, env))

    def _wait_ready(self, child: _Child, deadline: float) -> None:
        def ready() -> bool:
            if child.proc.poll() is not None:
                raise FleetError(
                    f"{child.name} exited with code {child.proc.returncode}: {_tail(child.log)}"
                )
            return self._get_status(f"{child.url}/readyz") == 200

        self._wait_until(deadline, ready, f"{child.name} to become ready")

    def _wait_until(self, deadline: float, check: Any, what: str) -> None:
        while True:
            self._check_alive()
            if check():
                return
            if time.monotonic() > deadline:
                raise FleetError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def _check_alive(self) -> None:
        for child in self._children:
            if child.proc.poll() is not None:
                raise FleetError(
                    f"{child.name} exited with code {child.proc.returncode}: {_tail(child.log)}"
                )

    @staticmethod
    def _get_status(url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (OSError, ValueError):
            return 0

    @staticmethod
    def _get_json(url: str, token: str = "") -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                        timeout=2.0) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                data = json.loads(exc.read())
            except ValueError:
                return {}
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    # The child leads its own group (start_new_session): the group id is its pid, valid for
    # signalling the group even after the leader has exited while members remain.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _tail(log: Path, num_lines: int = 5) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {log})"
    return " | ".join(lines[-num_lines:]) or f"(empty log {log})"
