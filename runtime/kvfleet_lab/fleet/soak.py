"""The soak (`kvfleet bench soak`, issue 44 item 3): a fleet under a bounded load for minutes while
faults land on a schedule; every request accounted for.

The fleet is real processes on 127.0.0.1 (`kvfleet_lab.demo.LocalFleet`): a router, three
replicas of the tiny checkpoint, and Redis as the hint index (one server, or a Redis Cluster of
three masters with a replica each), each role with its own ACL user (`hint_index.ACL_USERS`) and
the fleet's keyed block names. A closed loop of `concurrency` clients sends completions of
mixed tenants (each tenant a few shared prefixes and a fresh suffix; one request in four
streamed) through the router for `duration_s`. The faults, in order, evenly spaced after a
warm-up (`FAULTS`):

    replica_kill    r1 SIGKILLed (no drain), restarted after `outage_s` (same port and config)
    redis_restart   the Redis server (on a cluster: a master) killed and started again
    config_rewrite  r2's watched config rewritten valid (max_tokens changed), invalid (a control
                    byte: refused, last good kept), then valid (the original) again
    peer_cut        every T2 connection to r0 cut after `PEER_CUT_AFTER_BYTES` of its answer
                    (r0's peers reach it through a proxy, the only mock: a cut mid-body is not a
                    fault a real part produces on demand), while prompts r0 holds are sent to
                    r1 and r2 directly, so their T2 fetches from r0 are cut mid-transfer
    slow_client     one stream read one chunk a second, and one body sent too slowly (408)

Every answer is classified (`classify`): `ok`, a failure the docs promise (docs/api.md
"Errors": 503 `no_replica`/`overloaded`/`shutting_down` with Retry-After, a stream ended by the
`upstream_failed` error event after its first token, 408 `body_timeout` for the slow body), or
`unexplained` (anything else: a 500, a 502, a reset, a stream without `[DONE]` or error event).
Per time bucket: requests, p50/p99 latency of the successful ones, and the hit rate (cached
prompt tokens / prompt tokens of non-streamed answers). Every process's RSS and open fds at the
start (after the warm-up) and the end; a process that lived through the whole run must stay
within `RSS_GROWTH_BOUND` and `FD_GROWTH_BOUND`. After each fault: how long until the hit rate
is back to `RECOVERED_FRACTION` of what it was before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvfleet_lab.demo import FleetOptions, LocalFleet, ensure_model
from kvfleet_lab.fleet.redis_servers import (
    RedisCluster,
    RedisNode,
    cluster_ports,
    running_cluster,
)

__all__ = [
    "FAULTS",
    "FD_GROWTH_BOUND",
    "PROMISED",
    "RSS_GROWTH_BOUND",
    "SoakOptions",
    "SoakReport",
    "classify",
    "render",
    "run_soak",
]

FAULTS = ("replica_kill", "redis_restart", "config_rewrite", "peer_cut", "slow_client")
PROMISED = {
    (503, "no_replica"), (503, "overloaded"), (503, "shutting_down"),
    (200, "upstream_failed"),  # a stream cut after its first token: the error event
    (408, "body_timeout"),
}
"""(status, code) pairs docs/api.md promises a client may get; any other failure is unexplained."""
RSS_GROWTH_BOUND = (1.25, 64 << 20)
"""A process that lived through the run ends with RSS <= start * 1.25 + 64 MiB (the start is read
after the warm-up: imports, the model and the pools are in by then)."""
FD_GROWTH_BOUND = 16
"""... and at most this many more open file descriptors than at the start."""
RECOVERED_FRACTION = 0.9
PEER_CUT_AFTER_BYTES = 8192
"""A tiny-checkpoint block is 4 KiB of KV: a T2 answer of a 320-token prefix (20 blocks) is cut
after its second block."""
HINT_LOOKUP_BUDGET_S = 0.05
"""The hint lookup budget of every process: the 2 ms default is a quiet pod's; on a shared 2-core
box most lookups would miss it and the soak would measure the box, not the fleet."""
_PREFIX_TOKENS = 320
_SUFFIX_TOKENS = 24
_PREFIXES_PER_TENANT = 3
_TENANTS = ("acme", "globex", "initech", "umbrella")
_REQUEST_TIMEOUT_S = 60.0


@dataclass(slots=True)
class SoakOptions:
    work_dir: Path
    duration_s: float = 900.0
    redis: str = "single"
    """"single" (one redis-server) or "cluster" (three masters, a replica each)."""
    concurrency: int = 4
    bucket_s: float = 30.0
    outage_s: float = 10.0
    """How long the killed replica and Redis stay down."""
    model_dir: Path | None = None
    seed: int = 0


@dataclass(slots=True)
class Outcome:
    start_s: float
    latency_s: float
    kind: str
    """"load" (the closed loop), "direct" (peer_cut's requests to a replica), "slow_client"."""
    status: int
    cause: str
    """"ok", the error code, or what went wrong ("reset", "no [DONE]", ...)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stream: bool = False
    replica: str = ""

    @property
    def verdict(self) -> str:
        return classify(self.status, self.cause)


def classify(status: int, cause: str) -> str:
    """ "ok", "promised" (a failure the docs promise) or "unexplained"."""
    if status == 200 and cause == "ok":
        return "ok"
    return "promised" if (status, cause) in PROMISED else "unexplained"


@dataclass(slots=True)
class ProcessSample:
    name: str
    pid: int
    rss_bytes: int
    num_fds: int


@dataclass(slots=True)
class FaultRecord:
    name: str
    start_s: float
    end_s: float
    notes: dict[str, Any] = field(default_factory=dict)
    hit_rate_before: float | None = None
    recovery_s: float | None = None
    """Seconds from the fault's start to the end of the first bucket whose hit rate is back to
    `RECOVERED_FRACTION` of `hit_rate_before`; None: not within the run."""


@dataclass(slots=True)
class Bucket:
    start_s: float
    num_requests: int
    num_ok: int
    p50_s: float | None
    p99_s: float | None
    hit_rate: float | None


@dataclass(slots=True)
class SoakReport:
    options: dict[str, Any]
    duration_s: float
    num_sent: int
    num_ok: int
    failures: dict[str, int]
    """"verdict status cause (kind)" -> count, every request that was not `ok`."""
    num_unexplained: int
    buckets: list[Bucket]
    faults: list[FaultRecord]
    processes_start: list[ProcessSample]
    processes_end: list[ProcessSample]
    growth_violations: list[str]
    """Processes that lived through the run and grew past the bounds; [] when flat."""
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The machine's at the end (1, 5, 15 minutes)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- the fault-injecting proxy -------------------------------------------------------------------


class CutProxy:
    """A TCP proxy to one replica's port; while `cut_after_bytes` is set each connection's answer
    is cut (both sides closed) after that many bytes of it."""

    def __init__(self, target_port: int = 0) -> None:
        self.target_port = target_port
        self.cut_after_bytes: int | None = None
        self.num_connections = 0
        self.num_cut = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, answer: bool) -> None:
            sent = 0
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(1 << 14):
                    limit = self.cut_after_bytes if answer else None
                    if limit is not None and sent + len(data) > limit:
                        dst.write(data[: max(0, limit - sent)])
                        self.num_cut += 1
                        break
                    dst.write(data)
                    sent += len(data)
                    await dst.drain()
            for w in (client_w, up_w):
                w.close()

        await asyncio.gather(pump(client_r, up_w, False), pump(up_r, client_w, True))


# -- requests ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Prompts:
    rng: random.Random
    prefixes: dict[str, list[list[int]]]

    @classmethod
    def make(cls, seed: int) -> _Prompts:
        rng = random.Random(seed)
        prefixes = {t: [[rng.randrange(256) for _ in range(_PREFIX_TOKENS)]
                        for _ in range(_PREFIXES_PER_TENANT)] for t in _TENANTS}
        return cls(rng, prefixes)

    def next(self) -> tuple[str, list[int]]:
        tenant = self.rng.choice(_TENANTS)
        prefix = self.rng.choice(self.prefixes[tenant])
        return tenant, prefix + [self.rng.randrange(256) for _ in range(_SUFFIX_TOKENS)]


async def _complete(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                    prompt: list[int], *, stream: bool, t0: float, kind: str) -> Outcome:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": stream}
    start = time.monotonic()
    out = Outcome(start - t0, 0.0, kind, 0, "no answer", stream=stream)
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            out.status = resp.status
            out.replica = resp.headers.get("X-Kvfleet-Replica", "")
            if resp.status != 200:
                data = await resp.json(content_type=None)
                out.cause = str((data.get("error") or {}).get("code") or "no code")
            elif not stream:
                usage = (await resp.json(content_type=None))["usage"]
                out.prompt_tokens = int(usage["prompt_tokens"])
                out.cached_tokens = int(usage["prompt_tokens_details"]["cached_tokens"])
                out.cause = "ok"
            else:
                out.cause = "no [DONE]"
                async for line in resp.content:
                    text = line.strip()
                    if text == b"data: [DONE]":
                        out.cause = "ok"
                        break
                    if text.startswith(b"data: ") and b'"error"' in text:
                        error = json.loads(text[6:]).get("error") or {}
                        out.cause = str(error.get("code") or "error event without code")
                        break
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.cause = type(exc).__name__
    except (ValueError, KeyError, TypeError) as exc:
        out.cause = f"bad answer: {type(exc).__name__}"
    out.latency_s = time.monotonic() - start
    return out


# -- process figures -----------------------------------------------------------------------------


def _sample(name: str, pid: int) -> ProcessSample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = next((int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmRSS:")), 0)
    return ProcessSample(name, pid, rss_kb * 1024, num_fds)


def growth_violations(start: list[ProcessSample], end: list[ProcessSample]) -> list[str]:
    """Processes in both samples (same name and pid: they lived through the run) that grew
    past `RSS_GROWTH_BOUND` or `FD_GROWTH_BOUND`."""
    factor, slack = RSS_GROWTH_BOUND
    before = {(s.name, s.pid): s for s in start}
    out = []
    for e in end:
        s = before.get((e.name, e.pid))
        if s is None:
            continue
        if e.rss_bytes > s.rss_bytes * factor + slack:
            out.append(f"{e.name}: RSS {s.rss_bytes >> 20} -> {e.rss_bytes >> 20} MiB")
        if e.num_fds > s.num_fds + FD_GROWTH_BOUND:
            out.append(f"{e.name}: fds {s.num_fds} -> {e.num_fds}")
    return out


# -- the run -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _redis(options: SoakOptions, roles: dict[str, str]) -> Iterator[RedisNode | RedisCluster]:
    workdir = options.work_dir / "redis"
    if options.redis == "cluster":
        with running_cluster(cluster_ports(6), workdir, password=secrets.token_hex(8),
                             role_passwords=roles) as cluster:
            yield cluster
        return
    if options.redis != "single":
        raise ValueError(f"redis must be 'single' or 'cluster', got {options.redis!r}")
    node = RedisNode(cluster_ports(1)[0], workdir, password=secrets.token_hex(8),
                     role_passwords=roles)
    node.start()
    try:
        yield node
    finally:
        node.kill()


def _redis_pids(server: RedisNode | RedisCluster) -> dict[str, int]:
    nodes = server.nodes if isinstance(server, RedisCluster) else [server]
    return {f"redis:{n.port}": n.proc.pid for n in nodes if n.proc is not None}


def run_soak(options: SoakOptions, progress: Callable[[str], None] = lambda _: None
             ) -> SoakReport:
    """Start the fleet, soak it, stop everything; the report."""
    options.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = options.model_dir or ensure_model(
        Path.home() / ".cache" / "kvfleet" / "demo", "tiny", 0, options.work_dir / "model.log")
    roles = {"replica": secrets.token_hex(8), "router": secrets.token_hex(8)}
    with _redis(options, roles) as server:
        if isinstance(server, RedisCluster):
            replica_urls = tuple(server.seed_urls_for("replica")[:3])
            router_urls = tuple(server.seed_urls_for("router")[:3])
            fleet_redis: dict[str, Any] = {"redis_cluster_urls": replica_urls}
        else:
            replica_urls = (server.url_for("replica"),)
            router_urls = (server.url_for("router"),)
            fleet_redis = {"redis_url": replica_urls[0]}
        return asyncio.run(_soak(options, model_dir, server, fleet_redis, router_urls, progress))


async def _soak(options: SoakOptions, model_dir: Path, server: RedisNode | RedisCluster,
                fleet_redis: dict[str, Any], router_urls: tuple[str, ...],
                progress: Callable[[str], None]) -> SoakReport:
    # The proxy listens first so r0's peers can be pointed at it; it learns r0's port once the
    # fleet has one (nothing reaches r0 over T2 before the fleet is up).
    proxy = CutProxy()
    await proxy.start()
    fleet_opts = FleetOptions(
        model_dir=model_dir, work_dir=options.work_dir / "fleet", tenants=_TENANTS,
        num_replicas=3, router_redis_urls=router_urls, num_kv_blocks=256, num_t1_blocks=512,
        peer_urls={"r0": f"http://127.0.0.1:{proxy.port}"},
        # peer_cut cuts T2's HTTP streams at the proxy; over NIXL the bytes would bypass it (a
        # NIXL peer gone mid-read is tested with real agents: tests/runtime/fleet/test_t2_nixl.py)
        t2_nixl=False,
        hint_lookup_budget_s=HINT_LOOKUP_BUDGET_S, **fleet_redis)
    fleet = LocalFleet(fleet_opts)
    try:
        progress("starting the fleet")
        await asyncio.to_thread(fleet.start, cache_enabled=True)
        proxy.target_port = int(fleet.replica_urls["r0"].rsplit(":", 1)[1])
        return await _drive(options, fleet, server, proxy, progress)
    finally:
        await asyncio.to_thread(fleet.stop)
        await proxy.close()


async def _drive(options: SoakOptions, fleet: LocalFleet, server: RedisNode | RedisCluster,
                 proxy: CutProxy, progress: Callable[[str], None]) -> SoakReport:
    duration = options.duration_s
    warmup_s = 0.1 * duration
    fault_at = [duration * (0.15 + 0.15 * i) for i in range(len(FAULTS))]
    prompts = _Prompts.make(options.seed)
    outcomes: list[Outcome] = []
    faults: list[FaultRecord] = []
    t0 = time.monotonic()
    stop = t0 + duration
    samples: dict[str, list[ProcessSample]] = {}

    def processes() -> list[ProcessSample]:
        pids = {**fleet.pid_by_name, **_redis_pids(server)}
        return [s for n, p in sorted(pids.items()) if (s := _sample(n, p)) is not None]

    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=options.concurrency + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(i: int) -> None:
            n = 0
            while time.monotonic() < stop:
                tenant, prompt = prompts.next()
                headers = {"Authorization": f"Bearer {fleet.api_keys[tenant]}"}
                n += 1
                out = await _complete(session, fleet.router_url, headers, prompt,
                                      stream=(n + i) % 4 == 0, t0=t0, kind="load")
                outcomes.append(out)
                if out.verdict != "ok":
                    await asyncio.sleep(0.2)  # a client backs off after a failure

        async def faulted(name: str, at_s: float, run: Callable[[dict[str, Any]], Awaitable[None]]
                          ) -> None:
            await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
            record = FaultRecord(name, time.monotonic() - t0, 0.0)
            progress(f"{record.start_s:6.0f} s: {name}")
            try:
                await run(record.notes)
            except Exception as exc:  # a fault that could not be injected is in the report
                record.notes["error"] = f"{type(exc).__name__}: {exc}"[:300]
            record.end_s = time.monotonic() - t0
            faults.append(record)

        async def replica_kill(notes: dict[str, Any]) -> None:
            await asyncio.to_thread(fleet.kill, "r1")
            await asyncio.sleep(options.outage_s)
            began = time.monotonic()
            await asyncio.to_thread(fleet.restart, "r1")
            notes["restart_to_ready_s"] = round(time.monotonic() - began, 1)

        async def redis_restart(notes: dict[str, Any]) -> None:
            node = server.masters()[0] if isinstance(server, RedisCluster) else server
            notes["node"] = node.port
            await asyncio.to_thread(node.kill)
            await asyncio.sleep(options.outage_s)
            await asyncio.to_thread(node.start)

        async def config_rewrite(notes: dict[str, Any]) -> None:
            path = fleet.config_path("r2")
            original = path.read_bytes()
            changed = json.loads(original)
            changed["limits"]["max_tokens"] = 32
            steps = [("valid", json.dumps(changed).encode()),
                     ("invalid", b"limits: {max_tokens: 64}\nx: \x07\n"), ("valid", original)]
            for i, (what, content) in enumerate(steps):
                tmp = path.with_suffix(".soak")
                tmp.write_bytes(content)
                tmp.replace(path)
                await asyncio.sleep(2.0)  # ten polls of the watcher
                ready = await _json(session, f"{fleet.replica_urls['r2']}/readyz")
                notes[f"{i}_{what}"] = {k: ready.get(k) for k in (
                    "status", "config_polls", "config_applied_at_poll", "config_errors")}

        async def peer_cut(notes: dict[str, Any]) -> None:
            # A prefix nobody has seen, answered by r0 twice (stored and published), then sent
            # to r1 and r2 directly: each misses it, finds r0 in the hint index and fetches the
            # run over T2 through the proxy, which cuts the answer mid-body.
            # A loaded box can publish later than the wait: then r1 computes the prompt itself
            # and r2 fetches it from r1, past the proxy. A fresh prompt, a longer wait (bounded).
            tenant = _TENANTS[0]
            before = fleet.t2_counters()
            cut_before = proxy.num_cut
            for attempt, publish_wait_s in enumerate((1.0, 3.0, 6.0), 1):
                prompt = [prompts.rng.randrange(256)
                          for _ in range(_PREFIX_TOKENS + _SUFFIX_TOKENS)]
                for target in ("r0", "r0"):
                    outcomes.append(await _direct(session, fleet, target, tenant, prompt, t0))
                await asyncio.sleep(publish_wait_s)  # the publish reaches Redis
                proxy.cut_after_bytes = PEER_CUT_AFTER_BYTES
                try:
                    for target in ("r1", "r2"):
                        outcomes.append(await _direct(session, fleet, target, tenant, prompt,
                                                      t0))
                finally:
                    proxy.cut_after_bytes = None
                notes["attempts"] = attempt
                if proxy.num_cut > cut_before:
                    break
            notes["connections_cut"] = proxy.num_cut - cut_before
            after = fleet.t2_counters()
            notes["t2_fetches_during"] = {
                name: dict(Counter(after[name].get("fetches", {}))
                           - Counter(before.get(name, {}).get("fetches", {})))
                for name in after}

        async def slow_client(notes: dict[str, Any]) -> None:
            notes["slow_reader"] = await _slow_reader(fleet, t0, outcomes)
            notes["slow_body"] = await _slow_body(fleet, t0, outcomes)

        runs = dict(zip(FAULTS, (replica_kill, redis_restart, config_rewrite, peer_cut,
                                 slow_client), strict=True))

        async def sampler() -> None:
            await asyncio.sleep(warmup_s)
            samples["start"] = processes()
            while time.monotonic() < stop:
                await asyncio.sleep(min(options.bucket_s, max(0.0, stop - time.monotonic())))
            samples["end"] = processes()

        progress(f"soaking for {duration:.0f} s, faults at "
                 + ", ".join(f"{a:.0f}" for a in fault_at))
        async def schedule() -> None:
            # One after another: a fault starts at its time or when the previous one is over
            # (a restarted replica is ready), so no two overlap.
            for name, at in zip(FAULTS, fault_at, strict=True):
                await faulted(name, at, runs[name])

        await asyncio.gather(*(client(i) for i in range(options.concurrency)), schedule(),
                             sampler())
    elapsed = time.monotonic() - t0
    buckets = _buckets(outcomes, options.bucket_s, elapsed)
    for record in faults:
        _recovery(record, buckets, options.bucket_s)
    failures = Counter(f"{o.verdict} {o.status} {o.cause} ({o.kind})" for o in outcomes
                       if o.verdict != "ok")
    start, end = samples.get("start", []), samples.get("end", [])
    return SoakReport(
        options={"duration_s": duration, "redis": options.redis,
                 "concurrency": options.concurrency, "bucket_s": options.bucket_s,
                 "outage_s": options.outage_s, "replicas": 3, "model": "tiny"},
        duration_s=round(elapsed, 1),
        num_sent=len(outcomes),
        num_ok=sum(o.verdict == "ok" for o in outcomes),
        failures=dict(sorted(failures.items())),
        num_unexplained=sum(o.verdict == "unexplained" for o in outcomes),
        buckets=buckets,
        faults=faults,
        processes_start=start,
        processes_end=end,
        growth_violations=growth_violations(start, end),
        load_average=os.getloadavg(),
    )


async def _direct(session: aiohttp.ClientSession, fleet: LocalFleet, replica: str, tenant: str,
                  prompt: list[int], t0: float) -> Outcome:
    """A completion sent to `replica` itself, with the router's signed tenant assertion."""
    from kvfleet_runtime.auth import sign_assertion
    from kvfleet_runtime.wire import ASSERTION_HEADER, TENANT_HEADER

    headers = {TENANT_HEADER: tenant, ASSERTION_HEADER: sign_assertion(
        fleet.router_secret.encode(), tenant, audience=replica, method="POST",
        path="/v1/completions", now_s=time.time())}
    out = await _complete(session, fleet.replica_urls[replica], headers, prompt, stream=False,
                          t0=t0, kind="direct")
    out.replica = replica
    return out


async def _json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with session.get(url) as resp:
            data = await resp.json(content_type=None)
            if isinstance(data, dict):
                data["status"] = resp.status
                return data
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass
    return {}


async def _slow_reader(fleet: LocalFleet, t0: float, outcomes: list[Outcome]) -> str:
    """A stream whose client reads 512 bytes a second (an event is about 250): the relay waits
    on it without holding up the others, and the stream completes."""
    body = {"prompt": list(range(64)), "max_tokens": 16, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {fleet.api_keys[_TENANTS[0]]}"}
    start = time.monotonic()
    out = Outcome(start - t0, 0.0, "slow_client", 0, "no [DONE]", stream=True)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S),
        connector=aiohttp.TCPConnector(limit=1),
    ) as session:
        try:
            async with session.post(f"{fleet.router_url}/v1/completions", json=body,
                                    headers=headers, read_bufsize=256) as resp:
                out.status = resp.status
                while chunk := await resp.content.read(512):
                    if b"data: [DONE]" in chunk:
                        out.cause = "ok"
                    await asyncio.sleep(1.0)
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.cause = type(exc).__name__
    out.latency_s = time.monotonic() - start
    outcomes.append(out)
    return f"{out.status} {out.cause} after {out.latency_s:.0f} s"


async def _slow_body(fleet: LocalFleet, t0: float, outcomes: list[Outcome]) -> str:
    """A body promised (`Content-Length: 100`) and never finished: 408 `body_timeout`."""
    host, port = fleet.router_url.removeprefix("http://").split(":")
    start = time.monotonic()
    out = Outcome(start - t0, 0.0, "slow_client", 0, "no answer")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                      f"Authorization: Bearer {fleet.api_keys[_TENANTS[0]]}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                      '{"prompt": [1, 2').encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
        out.status = int(head.split(b" ", 2)[1])
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        data = json.loads(await asyncio.wait_for(reader.readexactly(length), 5.0))
        out.cause = str((data.get("error") or {}).get("code") or "no code")
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        out.cause = type(exc).__name__
    finally:
        writer.close()
    out.latency_s = time.monotonic() - start
    outcomes.append(out)
    return f"{out.status} {out.cause} after {out.latency_s:.0f} s"


def _buckets(outcomes: list[Outcome], bucket_s: float, elapsed_s: float) -> list[Bucket]:
    out = []
    for i in range(max(1, int(elapsed_s // bucket_s) + 1)):
        lo, hi = i * bucket_s, (i + 1) * bucket_s
        these = [o for o in outcomes if lo <= o.start_s < hi and o.kind == "load"]
        if not these:
            continue
        ok = sorted(o.latency_s for o in these if o.verdict == "ok")
        plain = [o for o in these if o.verdict == "ok" and not o.stream and o.prompt_tokens]
        prompt = sum(o.prompt_tokens for o in plain)
        out.append(Bucket(
            start_s=lo, num_requests=len(these), num_ok=len(ok),
            p50_s=round(statistics.median(ok), 4) if ok else None,
            p99_s=round(ok[min(len(ok) - 1, int(0.99 * len(ok)))], 4) if ok else None,
            hit_rate=round(sum(o.cached_tokens for o in plain) / prompt, 3) if prompt else None,
        ))
    return out


def _recovery(record: FaultRecord, buckets: list[Bucket], bucket_s: float) -> None:
    window_s = (record.start_s - 2 * bucket_s, record.start_s)
    before = [b.hit_rate for b in buckets if b.hit_rate is not None
              and window_s[0] <= b.start_s and b.start_s + bucket_s <= window_s[1]]
    if not before:
        return
    record.hit_rate_before = round(sum(before) / len(before), 3)
    for b in buckets:
        if b.start_s + bucket_s <= record.start_s or b.hit_rate is None:
            continue
        if b.hit_rate >= RECOVERED_FRACTION * record.hit_rate_before:
            record.recovery_s = round(b.start_s + bucket_s - record.start_s, 1)
            return


def render(report: SoakReport) -> str:
    """The report as text: totals, failures, buckets, faults, processes."""
    lines = [f"soak {report.duration_s:.0f} s, {report.options}, load average at the end "
             f"{report.load_average[0]:.1f} {report.load_average[1]:.1f} "
             f"{report.load_average[2]:.1f}",
             f"sent {report.num_sent}, ok {report.num_ok}, unexplained {report.num_unexplained}"]
    lines += [f"  {n:6d}  {what}" for what, n in report.failures.items()]
    lines.append("   t_s   reqs    ok   p50_ms   p99_ms   hit")
    for b in report.buckets:
        p50 = f"{b.p50_s * 1000:8.0f}" if b.p50_s is not None else "       -"
        p99 = f"{b.p99_s * 1000:8.0f}" if b.p99_s is not None else "       -"
        hit = f"{b.hit_rate:5.2f}" if b.hit_rate is not None else "    -"
        lines.append(f"{b.start_s:6.0f} {b.num_requests:6d} {b.num_ok:5d} {p50} {p99} {hit}")
    for f in report.faults:
        lines.append(f"fault {f.name} at {f.start_s:.0f}-{f.end_s:.0f} s: hit rate before "
                     f"{f.hit_rate_before}, back to {RECOVERED_FRACTION:.0%} of it within "
                     f"{f.recovery_s} s; {json.dumps(f.notes)[:400]}")
    end = {(s.name, s.pid): s for s in report.processes_end}
    for s in report.processes_start:
        e = end.get((s.name, s.pid))
        tail = (f"-> {e.rss_bytes >> 20} MiB, {e.num_fds} fds" if e is not None
                else "(restarted: not compared)")
        lines.append(f"process {s.name}: {s.rss_bytes >> 20} MiB, {s.num_fds} fds {tail}")
    lines.append("growth: " + ("; ".join(report.growth_violations) or "within bounds "
                               f"(RSS <= x{RSS_GROWTH_BOUND[0]} + {RSS_GROWTH_BOUND[1] >> 20} "
                               f"MiB, fds <= +{FD_GROWTH_BOUND})"))
    return "\n".join(lines)
