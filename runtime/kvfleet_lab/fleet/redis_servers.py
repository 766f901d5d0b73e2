"""Real Redis servers on loopback for tests and benchmarks: one standalone server, or a Redis
Cluster of `num_masters` masters with `replicas_per_master` replicas each (Debian's `redis-server`
in cluster mode, joined by `redis-cli --cluster create`).

Each server runs without persistence, bound to 127.0.0.1, in its own folder. The cluster is set up
as a platform team would run it for a hint index: `cluster-require-full-coverage no` (a shard
that is down fails only its own slots, never the whole keyspace) and a short
`cluster-node-timeout` so a replica is promoted within seconds of its master dying.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_runtime.fleet.hint_index import ACL_RULES, ACL_USERS

__all__ = [
    "REDIS_CLI",
    "REDIS_SERVER",
    "RedisCluster",
    "RedisNode",
    "cluster_ports",
    "redis_tools_missing",
    "running_cluster",
]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
CLUSTER_NODE_TIMEOUT_MS = 1000
"""How long a master may be silent before the others mark it failed and promote its replica."""


_CLUSTER_BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10,000 (the cluster bus), so its port is <= 55,535."""
_handed_out: set[int] = set()


def cluster_ports(num_ports: int) -> list[int]:
    """`num_ports` loopback ports, each free with its bus port, never handed out twice here."""
    rng = random.Random()
    ports: list[int] = []
    for _ in range(num_ports * 200):
        if len(ports) == num_ports:
            return ports
        port = rng.randrange(20_000, 45_000)
        if port in _handed_out or not _bindable(port) or not _bindable(port + _CLUSTER_BUS_OFFSET):
            continue
        _handed_out.add(port)
        ports.append(port)
    raise RuntimeError(f"no {num_ports} free loopback port pairs found")


def _bindable(port: int) -> bool:
    with contextlib.closing(socket.socket()) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def redis_tools_missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    for tool in (REDIS_SERVER, REDIS_CLI):
        if not Path(tool).exists():
            return f"{tool} is not installed (apt-get install redis-server redis-tools)"
    return None


def _send(port: int, command: bytes, password: str, timeout_s: float = 0.5) -> bytes:
    """One inline command on a fresh connection; b"" when the server does not answer."""
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn,
    ):
        auth = f"AUTH {password}\r\n".encode() if password else b""
        conn.sendall(auth + command + b"\r\n")
        answer = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = conn.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
            if answer.endswith(b"\r\n") and (not auth or answer.count(b"\r\n") >= 2):
                # A bulk reply ($n) needs its body too.
                body = answer.split(b"\r\n", 1)[1] if auth else answer
                if not body.startswith(b"$") or body.count(b"\r\n") >= 2:
                    break
        return answer
    return b""


@dataclass
class RedisNode:
    """One redis-server child, standalone or a cluster node."""

    port: int
    workdir: Path
    cluster: bool = False
    password: str = ""
    role_passwords: dict[str, str] = field(default_factory=dict)
    """Role ("replica", "router") -> password: the server also has the hint index's ACL user of
    each (`fleet.hint_index.ACL_USERS`, `ACL_RULES`), as the chart's Redis does; the default
    user (`password`) stays the administrator's."""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def url_for(self, role: str) -> str:
        """The URL a process of `role` uses (its ACL user), or `url` without ACL users."""
        if role not in self.role_passwords:
            return self.url
        return (f"redis://{ACL_USERS[role]}:{self.role_passwords[role]}@127.0.0.1:"
                f"{self.port}/0")

    def command(self, line: str, timeout_s: float = 0.5) -> str:
        return _send(self.port, line.encode(), self.password, timeout_s).decode(errors="replace")

    def start(self) -> None:
        assert self.proc is None
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--protected-mode", "yes",
            "--logfile", str(self.workdir / "redis.log"),
        ]
        if self.password:
            # masterauth: a replica authenticates to its master with the same password.
            args += ["--requirepass", self.password, "--masterauth", self.password]
        for role, secret in self.role_passwords.items():
            args += ["--user", ACL_USERS[role], "on", f">{secret}", *ACL_RULES[role].split()]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / "nodes.conf"),
                "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "no",
            ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.command("PING").endswith("+PONG\r\n"):
                return
            if self.proc.poll() is not None:
                log = self.workdir / "redis.log"
                tail = log.read_text(errors="replace")[-1000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {tail}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not answer PING within 10 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _wait(what: str, ok: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} within {timeout_s:.0f} s")


@dataclass
class RedisCluster:
    """`num_masters` masters + `replicas_per_master` replicas each, on the given ports."""

    ports: Sequence[int]
    workdir: Path
    replicas_per_master: int = 1
    password: str = ""
    role_passwords: dict[str, str] = field(default_factory=dict)
    """As `RedisNode.role_passwords`, on every node."""
    nodes: list[RedisNode] = field(default_factory=list)

    @property
    def seed_urls(self) -> list[str]:
        """Every node's URL (a client needs one that answers; the chart lists several)."""
        return [n.url for n in self.nodes]

    def seed_urls_for(self, role: str) -> list[str]:
        """Every node's URL for a process of `role` (its ACL user)."""
        return [n.url_for(role) for n in self.nodes]

    def start(self, timeout_s: float = 60.0) -> None:
        self.nodes = [
            RedisNode(p, self.workdir / str(p), cluster=True, password=self.password,
                      role_passwords=dict(self.role_passwords))
            for p in self.ports
        ]
        for node in self.nodes:
            node.start()
        cmd = [REDIS_CLI, "--cluster", "create", *(n.address for n in self.nodes),
               "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
        if self.password:
            cmd += ["-a", self.password, "--no-auth-warning"]
        done = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]!r}")
        _wait("the cluster did not reach cluster_state:ok on every node",
              lambda: all("cluster_state:ok" in n.command("CLUSTER INFO") for n in self.nodes),
              timeout_s)
        # Replicas attach asynchronously: wait until every master reports its replicas.
        _wait("the replicas did not attach", self._replicas_attached, timeout_s)

    def _replicas_attached(self) -> bool:
        masters = self.masters()
        return len(masters) * (1 + self.replicas_per_master) == len(self.nodes) and all(
            f"connected_slaves:{self.replicas_per_master}" in m.command("INFO replication")
            for m in masters
        )

    def roles(self) -> dict[int, str]:
        """port -> "master" / "slave" as each live node sees itself."""
        out: dict[int, str] = {}
        for node in self.nodes:
            if not node.alive:
                continue
            info = node.command("INFO replication")
            out[node.port] = "master" if "role:master" in info else "slave"
        return out

    def masters(self) -> list[RedisNode]:
        roles = self.roles()
        return [n for n in self.nodes if roles.get(n.port) == "master"]

    def master_of_slot(self, slot: int) -> RedisNode:
        """The live node that `CLUSTER SHARDS`-style ownership gives `slot` (from CLUSTER SLOTS
        as a live master reports it)."""
        for node in self.masters():
            for line in node.command("CLUSTER NODES", timeout_s=1.0).splitlines():
                parts = line.split()
                if len(parts) < 9 or "myself" not in parts[2] or "master" not in parts[2]:
                    continue
                for spec in parts[8:]:
                    lo, _, hi = spec.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return node
        raise LookupError(f"no live master owns slot {slot}")

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Every live node says cluster_state:ok (after a failover: the replica was promoted)."""
        _wait("the cluster did not recover cluster_state:ok",
              lambda: all("cluster_state:ok" in n.command("CLUSTER INFO")
                          for n in self.nodes if n.alive), timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


@contextlib.contextmanager
def running_cluster(ports: Sequence[int], workdir: Path, *, replicas_per_master: int = 1,
                    password: str = "", role_passwords: dict[str, str] | None = None
                    ) -> Iterator[RedisCluster]:
    cluster = RedisCluster(ports, workdir, replicas_per_master=replicas_per_master,
                           password=password, role_passwords=dict(role_passwords or {}))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
