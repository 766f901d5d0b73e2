"""`kvfleet bench fleet`: T2 loopback bandwidth vs a raw socket, router overhead, and fleet token
hit rate under affinity / random / least-loaded routing vs the single-shared-infinite-cache bound.

- T2 bandwidth: a server process holds a run of blocks in a real `PrefixCache` and serves it over
  the T2 endpoint; this process fetches it with `PeerFetcher` (checksums and all) and compares
  with a server process that `sendall`s the same number of bytes over a plain TCP socket. Where
  NIXL is installed the same server also serves T2 over NIXL (its pools registered with its
  agent, the lease routes): this process fetches the run with `PeerFetcher.lease_into` (lease,
  checks, one-sided READ into its own registered blocks, release) and compares with a bare
  NIXL READ of the same bytes between the same two processes (the descriptors of one lease held
  for the whole bench, no control request). The server's CPU seconds per GiB served are read
  from its /proc stat around each path's transfers.
- Router overhead: a `kvfleet router` process in front of an instant echo replica process;
  the same requests are timed through the router and straight to the replica.
- Hit rates: a simulation over real cache instances: one `CacheManager` per replica (the shipped
  index, admission and eviction, torch-free), fed the Mooncake trace's chained block hashes. Each
  request's "tenant" is its root block (the trace has no tenant field; a shared root means a
  shared system prompt/template). Load is simulated from the trace's timestamps: a replica's
  prefill is a FIFO server of `prefill_tokens_per_s`, and its KV occupancy is the prompt tokens of
  its unfinished requests over `kv_capacity_tokens`. Affinity is `routing.choose_replica` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvfleet_lab.cache.sim import (
    SIM_KEY,
    TraceRequest,
    load_mooncake_trace,
    simulate_infinite,
    unique_blocks,
)
from kvfleet_lab.processes import free_port
from kvfleet_runtime.affinity import ReplicaLoad, choose_replica, least_loaded
from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey, CacheManager, CacheTuning, block_hashes

__all__ = [
    "FleetBenchReport",
    "HitRateResult",
    "bench_hit_rates",
    "bench_router_overhead",
    "bench_t2_bandwidth",
    "serve_echo_replica",
    "serve_raw",
    "serve_t2",
]

BENCH_SECRET = b"kvfleet-bench-secret"
BENCH_LEASE_TTL_S = 600.0
"""The bench server's lease life: the bare NIXL READ keeps one lease for the whole bench."""
BENCH_KEY = CacheKey("bench", "bench-model", "sha256:" + "1" * 64, "float16", "rope", "sdpa")


def _tokens(num_tokens: int) -> list[int]:
    return [(7 * i + 3) % 50_000 for i in range(num_tokens)]


# -- server processes ----------------------------------------------------------------------------


def serve_t2(port: int, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int) -> None:
    """Process entry: a PrefixCache holding `num_tokens` of KV, served over T2 on `port`."""
    import torch
    from aiohttp import web

    from kvfleet_runtime.cache import KVLayout, PrefixCache
    from kvfleet_runtime.fleet import peer_routes
    from kvfleet_runtime.fleet.t2_source import CacheBlockSource

    layout = KVLayout(num_layers, num_kv_heads, head_dim, dtype="float16")
    num_blocks = num_tokens // BLOCK_SIZE
    cache = PrefixCache(
        CacheTuning(
            num_t0_blocks=num_blocks + 8,
            admit_min_sightings=1,
            hot_min_sightings=2,
            store_queue_max_entries=4,
        ),
        layout,
        clock=time.monotonic,
    )
    shape = (num_layers, num_kv_heads, num_blocks * BLOCK_SIZE, head_dim)
    k, v = torch.randn(shape).half(), torch.randn(shape).half()
    cache.store(BENCH_KEY, _tokens(num_blocks * BLOCK_SIZE), k, v)
    cache.drain_store_queue()
    from kvfleet_runtime.fleet.t2_lease import LeaseTable
    from kvfleet_runtime.fleet.t2_nixl import NixlAgent
    from kvfleet_runtime.fleet.t2_serve import lease_routes

    agent = NixlAgent.start("bench-server", cache.pools())
    serving = None if agent is None else agent.serving()
    source = CacheBlockSource(cache)
    app = web.Application(client_max_size=64 << 20)
    app.add_routes(peer_routes(source, BENCH_SECRET))
    app.add_routes(lease_routes(source, BENCH_SECRET, serving,
                                LeaseTable(ttl_s=BENCH_LEASE_TTL_S, max_blocks=4 * num_blocks + 8,
                                           clock=time.monotonic)))
    _serve_forever(app, port)


def serve_raw(port: int, num_bytes: int) -> None:
    """Process entry: the raw-socket baseline. Sends `num_bytes` from one buffer, allocated and
    touched once up front, for every request byte received on a connection (connections are
    kept, as T2's HTTP connection is)."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (num_bytes // (1 << 20) + 1))
    payload = payload[:num_bytes]
    with socket.create_server(("127.0.0.1", port)) as server:
        print("READY", flush=True)  # noqa: T201 - the parent waits for this line
        while True:
            conn, _ = server.accept()
            with conn:
                while conn.recv(1):
                    conn.sendall(payload)


def serve_echo_replica(port: int) -> None:
    """Process entry: an instant replica (load report + completions echo) for router overhead."""
    from aiohttp import web

    from kvfleet_runtime.wire import LOAD_PATH

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}]})

    async def load(request: web.Request) -> web.StreamResponse:
        return web.json_response({"ready": True, "kv_occupancy": 0.1})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get(LOAD_PATH, load)
    _serve_forever(app, port)


def _serve_forever(app: Any, port: int) -> None:
    """Listen on 127.0.0.1:`port`, then tell the parent (READY on stdout), then serve."""
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("READY", flush=True)  # noqa: T201 - the parent waits for this line
        await asyncio.Event().wait()

    asyncio.run(main())


@contextlib.contextmanager
def _process(code: str, *, ready: str = "READY",
             timeout_s: float = 120.0) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while ready not in line:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"bench server did not start: {code[:80]}")
            line = proc.stdout.readline()
        # Keep the pipe drained (NIXL logs on stdout): a full pipe would stall the server.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def _wait_http(url: str, timeout_s: float = 30.0) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status < 500:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


# -- T2 bandwidth --------------------------------------------------------------------------------


@dataclass(slots=True)
class T2Result:
    num_bytes: int
    t2_median_s: float
    raw_median_s: float
    paired_ratio_median: float = 0.0
    """Median over repetitions of raw time / T2 time, each pair measured back to back."""
    t2_times_s: list[float] = field(default_factory=list)
    raw_times_s: list[float] = field(default_factory=list)
    nixl: NixlResult | None = None
    """T2 over NIXL beside a bare NIXL READ (None: NIXL is not installed here)."""
    server_cpu_s_per_gib: float = 0.0
    """The serving process's CPU seconds (user + system) per GiB it served over HTTP T2."""

    @property
    def t2_gb_s(self) -> float:
        return self.num_bytes / self.t2_median_s / 1e9

    @property
    def raw_gb_s(self) -> float:
        return self.num_bytes / self.raw_median_s / 1e9

    @property
    def ratio(self) -> float:
        return self.raw_median_s / self.t2_median_s


@dataclass(slots=True)
class NixlResult:
    """T2 over NIXL (lease, checks, one-sided READ, release) and a bare NIXL READ of the same
    bytes between the same two processes, alternating, medians."""

    t2_median_s: float
    bare_median_s: float
    paired_ratio_median: float
    """Median over repetitions of bare time / T2-over-NIXL time, measured back to back."""
    t2_times_s: list[float] = field(default_factory=list)
    bare_times_s: list[float] = field(default_factory=list)
    server_cpu_s_per_gib: float = 0.0
    """The serving process's CPU seconds per GiB served over NIXL (control requests, and
    whatever UCX's transport costs it)."""
    backend: str = "UCX"

    @property
    def t2_vs_bare_nixl(self) -> float:
        return self.bare_median_s / self.t2_median_s


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_t2_bandwidth(
    *,
    num_layers: int = 8,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    num_tokens: int = 2000,
    reps: int = 7,
) -> T2Result:
    """`reps` fetches of one block run over T2, each next to a raw-socket transfer of the same
    bytes, under the same conditions: both servers up at once, alternating, on kept connections,
    sending from memory already allocated (the T2 server's cache pool and reused send buffers;
    the raw server's one buffer) into memory already allocated (the fetcher's recycled receive
    buffers; one reused buffer), after a warm-up of each. Medians of each, and of the ratios."""
    num_blocks = num_tokens // BLOCK_SIZE
    if num_blocks < 1 or reps < 1:
        raise ValueError(f"need num_tokens >= {BLOCK_SIZE} and reps >= 1")
    num_bytes = 2 * num_layers * num_kv_heads * num_blocks * BLOCK_SIZE * head_dim * 2
    t2_port, raw_port = free_port(), free_port()
    t2_code = (
        "from kvfleet_lab.fleet.bench import serve_t2; "
        f"serve_t2({t2_port}, {num_layers}, {num_kv_heads}, {head_dim}, {num_tokens})"
    )
    raw_code = (
        f"from kvfleet_lab.fleet.bench import serve_raw; serve_raw({raw_port}, {num_bytes})"
    )
    url = f"http://127.0.0.1:{t2_port}"
    with _process(t2_code) as server, _process(raw_code):
        cpu = _cpu_s(server.pid)
        t2_times, raw_times = asyncio.run(
            _fetch_pairs(url, raw_port, num_blocks, num_bytes, reps)
        )
        http_cpu = _cpu_s(server.pid) - cpu
        nixl = _bench_nixl(url, server.pid, (num_layers, num_kv_heads, head_dim), num_blocks,
                           num_bytes, reps)
    gib_served = (reps + 1) * num_bytes / 2**30
    return T2Result(
        num_bytes,
        statistics.median(t2_times),
        statistics.median(raw_times),
        statistics.median(r / t for t, r in zip(t2_times, raw_times, strict=True)),
        t2_times,
        raw_times,
        nixl,
        http_cpu / gib_served,
    )


def _bench_nixl(url: str, server_pid: int, layout: tuple[int, int, int], num_blocks: int,
                num_bytes: int, reps: int) -> NixlResult | None:
    """T2 over NIXL and a bare NIXL READ against the server at `url`, or None without NIXL."""
    import torch

    from kvfleet_runtime.cache import KVLayout, PagedBlocks
    from kvfleet_runtime.fleet.t2_nixl import NixlAgent

    layers, heads, head_dim = layout
    kv = PagedBlocks.zeros(KVLayout(layers, heads, head_dim, dtype="float16"), num_blocks,
                           torch.device("cpu"))
    agent = NixlAgent.start("bench-client", [kv])
    if agent is None:
        return None
    try:
        cpu = _cpu_s(server_pid)
        t2_times, bare_times, cpu_bare = asyncio.run(
            _nixl_pairs(url, agent, layout, num_blocks, num_bytes, reps, server_pid))
        nixl_cpu = _cpu_s(server_pid) - cpu - cpu_bare
    finally:
        agent.close()
    return NixlResult(
        statistics.median(t2_times),
        statistics.median(bare_times),
        statistics.median(b / t for t, b in zip(t2_times, bare_times, strict=True)),
        t2_times,
        bare_times,
        nixl_cpu / ((reps + 1) * num_bytes / 2**30),
    )


async def _nixl_pairs(
    url: str, agent: Any, layout: tuple[int, int, int], num_blocks: int, num_bytes: int,
    reps: int, server_pid: int,
) -> tuple[list[float], list[float], float]:
    """(T2-over-NIXL times, bare READ times, the server's CPU seconds during the bare READs)."""
    import base64

    import aiohttp

    from kvfleet_runtime.fleet import PeerFetcher, peer_token
    from kvfleet_runtime.fleet.hint_index import EmbeddedHintIndex
    from kvfleet_runtime.fleet.t2_lease import PoolGeometry, pair_descriptors
    from kvfleet_runtime.wire import LEASE_PATH, TENANT_HEADER

    tokens = _tokens(num_blocks * BLOCK_SIZE)
    chain = block_hashes(BENCH_KEY, tokens)
    slots = [(0, i) for i in range(num_blocks)]
    fetcher = PeerFetcher(BENCH_SECRET, EmbeddedHintIndex(), "bench-client")
    tenant = BENCH_KEY.tenant_id
    # The bare READ's descriptors: one lease, held (BENCH_LEASE_TTL_S) for the whole bench.
    async with aiohttp.ClientSession() as session:
        body = {"key": BENCH_KEY._asdict(), "token_ids": tokens, "start_block": 0,
                "max_blocks": num_blocks}
        headers = {TENANT_HEADER: tenant,
                   "Authorization": f"Bearer {peer_token(BENCH_SECRET, tenant)}"}
        async with session.post(url + LEASE_PATH, json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the bench server answered {resp.status} to a lease")
            lease = await resp.json()
    remote = agent.add_remote(base64.b64decode(lease["metadata"]))
    descriptors = pair_descriptors(agent.geometries, slots,
                                   [PoolGeometry.from_json(g) for g in lease["pools"]],
                                   [tuple(s) for s in lease["slots"]])
    if sum(d.num_bytes for d in descriptors) != num_bytes:
        raise RuntimeError("the bench lease describes another number of bytes")

    async def t2() -> float:
        start = time.perf_counter()
        got = await fetcher.lease_into(
            url, BENCH_KEY, tokens, chain, start_block=0, dtype="float16", layout=layout,
            agent=agent, local_slots=slots, deadline_s=time.monotonic() + 30.0)
        elapsed = time.perf_counter() - start
        if got != num_blocks:
            raise RuntimeError(f"T2 over NIXL landed {got} of {num_blocks} blocks")
        return elapsed

    def bare() -> tuple[float, float]:
        cpu = _cpu_s(server_pid)
        start = time.perf_counter()
        if not agent.read(descriptors, remote, 30.0):
            raise RuntimeError("the bare NIXL READ failed")
        return time.perf_counter() - start, _cpu_s(server_pid) - cpu

    t2_times: list[float] = []
    bare_times: list[float] = []
    bare_cpu = 0.0
    for i in range(reps + 1):  # the first pair warms the connection and the agents
        if i % 2:
            t, (b, c) = await t2(), bare()
        else:
            (b, c), t = bare(), await t2()
        bare_cpu += c
        if i:
            t2_times.append(t)
            bare_times.append(b)
    return t2_times, bare_times, bare_cpu


async def _fetch_pairs(
    url: str, raw_port: int, num_blocks: int, num_bytes: int, reps: int
) -> tuple[list[float], list[float]]:
    from kvfleet_runtime.fleet import PeerFetcher
    from kvfleet_runtime.fleet.hint_index import EmbeddedHintIndex

    tokens = _tokens(num_blocks * BLOCK_SIZE)
    t2_times: list[float] = []
    raw_times: list[float] = []
    buf = np.ones(num_bytes, dtype=np.uint8).data.cast("B")  # allocated and touched
    with socket.create_connection(("127.0.0.1", raw_port)) as conn:
        fetcher = PeerFetcher(BENCH_SECRET, EmbeddedHintIndex(), "bench-client")

        async def t2() -> float:
            start = time.perf_counter()
            run = await fetcher.fetch_from(url, BENCH_KEY, tokens, 0, num_blocks)
            elapsed = time.perf_counter() - start
            got = len(run.k) + len(run.v)
            if got != num_bytes or run.num_blocks != num_blocks or run.partial:
                raise RuntimeError(f"T2 fetched {got} of {num_bytes} bytes ({run.partial})")
            fetcher.recycle(run)
            return elapsed

        for i in range(reps + 1):  # the first pair warms connections, servers and buffers
            # Alternate which goes first, so neither always follows the other's traffic.
            if i % 2:
                t, r = await t2(), _fetch_raw(conn, buf)
            else:
                r, t = _fetch_raw(conn, buf), await t2()
            if i:
                t2_times.append(t)
                raw_times.append(r)
    return t2_times, raw_times


def _fetch_raw(conn: socket.socket, view: memoryview) -> float:
    num_bytes = len(view)
    start = time.perf_counter()
    conn.sendall(b"G")
    got = 0
    while got < num_bytes:
        n = conn.recv_into(view[got:], num_bytes - got)
        if n == 0:
            raise RuntimeError("raw socket closed early")
        got += n
    return time.perf_counter() - start


# -- router overhead -----------------------------------------------------------------------------


@dataclass(slots=True)
class RouterOverheadResult:
    num_requests: int
    direct_p50_s: float
    direct_p99_s: float
    routed_p50_s: float
    routed_p99_s: float

    @property
    def overhead_p50_s(self) -> float:
        return self.routed_p50_s - self.direct_p50_s

    @property
    def overhead_p99_s(self) -> float:
        return self.routed_p99_s - self.direct_p99_s


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_router_overhead(*, num_requests: int = 500) -> RouterOverheadResult:
    """Sequential small completions through a `kvfleet router` process vs straight to the
    replica process; p50/p99 of each."""
    replica_port, router_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text(json.dumps({"tenants": {"bench": ["sk-bench"]}}))
        replica_code = (
            "from kvfleet_lab.fleet.bench import serve_echo_replica; "
            f"serve_echo_replica({replica_port})"
        )
        router_code = (
            # With a router secret, as deployed: the overhead includes signing the tenant.
            "import os; os.environ['KVFLEET_ROUTER_SECRET'] = 'bench-router-secret'; "
            "from kvfleet_runtime.cli import app; "
            f"app(['router', '--keys', {str(keys)!r}, '--port', '{router_port}', "
            f"'--replica', 'r0=http://127.0.0.1:{replica_port}', '--log-level', 'WARNING'])"
        )
        with _process(replica_code), _process(router_code, ready=""):
            return asyncio.run(_time_router(replica_port, router_port, num_requests))


async def _time_router(replica_port: int, router_port: int, n: int) -> RouterOverheadResult:
    import aiohttp

    await _wait_http(f"http://127.0.0.1:{router_port}/healthz")
    body = {"prompt": "hello " * 20, "max_tokens": 1}
    direct: list[float] = []
    routed: list[float] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(20):  # warm both paths and the router's view
            async with session.post(
                f"http://127.0.0.1:{router_port}/v1/completions",
                json=body,
                headers={"Authorization": "Bearer sk-bench"},
            ) as r:
                await r.read()
        for _ in range(n):
            for url, headers, out in (
                (
                    f"http://127.0.0.1:{replica_port}/v1/completions",
                    {"X-Kvfleet-Tenant": "bench"},
                    direct,
                ),
                (
                    f"http://127.0.0.1:{router_port}/v1/completions",
                    {"Authorization": "Bearer sk-bench"},
                    routed,
                ),
            ):
                start = time.perf_counter()
                async with session.post(url, json=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}")
                out.append(time.perf_counter() - start)
    return RouterOverheadResult(
        n, _pct(direct, 0.5), _pct(direct, 0.99), _pct(routed, 0.5), _pct(routed, 0.99)
    )


# -- fleet hit rates -----------------------------------------------------------------------------


@dataclass(slots=True)
class HitRateResult:
    policy: str
    token_hit_rate: float
    spill_rate: float = 0.0
    mean_queue_delay_s: float = 0.0
    per_replica_requests: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _SimReplica:
    name: str
    manager: CacheManager
    busy_until_s: float = 0.0
    active: list[tuple[float, int]] = field(default_factory=list)  # (finish_s, tokens)
    num_requests: int = 0

    def occupancy(self, now_s: float, kv_capacity_tokens: int) -> float:
        self.active = [(f, n) for f, n in self.active if f > now_s]
        return min(1.0, sum(n for _, n in self.active) / kv_capacity_tokens)


def _simulate_routing(
    requests: Sequence[TraceRequest],
    policy: str,
    *,
    num_replicas: int,
    capacity_blocks: int,
    k: int,
    threshold: float,
    prefill_tokens_per_s: float,
    kv_capacity_tokens: int,
    seed: int,
    admit_min_sightings: int,
) -> HitRateResult:
    clock = [0.0]
    cfg = CacheTuning(
        num_t0_blocks=capacity_blocks,
        admit_min_sightings=admit_min_sightings,
        hot_min_sightings=max(admit_min_sightings, 3),
    )
    replicas = [
        _SimReplica(
            f"r{i}", CacheManager(cfg, bytes_per_block=BLOCK_SIZE * 327_680, clock=lambda: clock[0])
        )
        for i in range(num_replicas)
    ]
    by_name = {r.name: r for r in replicas}
    rng = random.Random(seed)
    hit_tokens = total_tokens = spills = 0
    total_delay = 0.0
    recompute_s = 1.0 / prefill_tokens_per_s
    for req in requests:
        now = clock[0] = req.timestamp_s
        loads = [
            ReplicaLoad(
                r.name, r.occupancy(now, kv_capacity_tokens), max(0.0, r.busy_until_s - now)
            )
            for r in replicas
        ]
        if policy == "random":
            chosen = by_name[f"r{rng.randrange(num_replicas)}"]
        elif policy == "least-loaded":
            best = least_loaded(loads)
            assert best is not None
            chosen = by_name[best.name]
        else:
            tenant = req.blocks[0].hex() if req.blocks else "empty"
            matched = None
            if policy == "affinity+cache-aware":
                matched = {
                    r.name: r.manager.num_cached_blocks(req.blocks) * BLOCK_SIZE for r in replicas
                }
            decision = choose_replica(
                tenant,
                loads,
                k=k,
                occupancy_threshold=threshold,
                matched_tokens=matched,
                recompute_s_per_token=recompute_s,
            )
            assert decision is not None
            spills += decision.reason == "spill"
            chosen = by_name[decision.replica]
        hit = chosen.manager.replay(SIM_KEY, req.blocks, req.num_tokens) * BLOCK_SIZE
        hit_tokens += hit
        total_tokens += req.num_tokens
        start = max(now, chosen.busy_until_s)
        total_delay += start - now
        chosen.busy_until_s = start + (req.num_tokens - hit) / prefill_tokens_per_s
        chosen.active.append((chosen.busy_until_s, req.num_tokens))
        chosen.num_requests += 1
    n = len(requests)
    return HitRateResult(
        policy,
        hit_tokens / total_tokens if total_tokens else 0.0,
        spills / n if n else 0.0,
        total_delay / n if n else 0.0,
        [r.num_requests for r in replicas],
    )


@dataclass(slots=True)
class HitRateReport:
    num_requests: int
    num_replicas: int
    capacity_blocks: int
    unique_blocks: int
    bound: float
    results: list[HitRateResult]


def bench_hit_rates(
    trace: Path,
    *,
    num_replicas: int = 4,
    capacity_fraction: float = 1.0,
    k: int = 3,
    threshold: float = 0.85,
    prefill_tokens_per_s: float = 28_000.0,
    kv_capacity_tokens: int = 200_000,
    max_requests: int | None = None,
    seed: int = 0,
    admit_min_sightings: int = 2,
    policies: Sequence[str] = ("affinity", "affinity+cache-aware", "random", "least-loaded"),
) -> HitRateReport:
    """Each replica's cache holds `capacity_fraction / num_replicas` of the trace's unique blocks
    (the fleet's caches together hold `capacity_fraction` of the working set)."""
    if num_replicas < 1 or capacity_fraction <= 0:
        raise ValueError(
            f"need num_replicas >= 1 and capacity_fraction > 0, got "
            f"{num_replicas} and {capacity_fraction}"
        )
    requests = load_mooncake_trace(trace, max_requests=max_requests)
    unique = unique_blocks(requests)
    capacity = max(1, int(unique * capacity_fraction / num_replicas))
    bound = simulate_infinite(requests).token_hit_rate
    results = [
        _simulate_routing(
            requests,
            p,
            num_replicas=num_replicas,
            capacity_blocks=capacity,
            k=k,
            threshold=threshold,
            prefill_tokens_per_s=prefill_tokens_per_s,
            kv_capacity_tokens=kv_capacity_tokens,
            seed=seed,
            admit_min_sightings=admit_min_sightings,
        )
        for p in policies
    ]
    return HitRateReport(len(requests), num_replicas, capacity, unique, bound, results)


@dataclass(slots=True)
class FleetBenchReport:
    t2: T2Result | None = None
    router: RouterOverheadResult | None = None
    hit_rates: HitRateReport | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.t2 is not None:
            nixl = self.t2.nixl
            out["t2"] = {
                **asdict(self.t2),
                "t2_gb_s": self.t2.t2_gb_s,
                "raw_gb_s": self.t2.raw_gb_s,
                "ratio": self.t2.ratio,
                "ratio_paired_median": self.t2.paired_ratio_median,
            }
            if nixl is not None:
                n = self.t2.num_bytes
                out["t2"]["nixl"] = {
                    **asdict(nixl),
                    "t2_gb_s": n / nixl.t2_median_s / 1e9,
                    "bare_gb_s": n / nixl.bare_median_s / 1e9,
                }
                out["t2"]["t2_vs_bare_nixl"] = nixl.t2_vs_bare_nixl
        if self.router is not None:
            out["router"] = {
                **asdict(self.router),
                "overhead_p50_s": self.router.overhead_p50_s,
                "overhead_p99_s": self.router.overhead_p99_s,
            }
        if self.hit_rates is not None:
            out["hit_rates"] = asdict(self.hit_rates)
        return out
