"""`kvfleet bench router`: one router process's capacity, and its overhead at 50/80/100% of it,
with and without the cache-aware override (tokenize + hint lookup).

Parts, all real processes on loopback:

- stub replicas (`serve_stub_replica`): answer a completion at once; their load report carries a
  cache key and the byte tokenizer's name, so the router computes hashes and asks the index;
  each answer says how long the request took from the client's send to the replica's receipt
  (`time.perf_counter` is CLOCK_MONOTONIC, one clock for every process on the machine);
- a `kvfleet router` process in front of them (with `--recompute-s-per-token` and a real
  redis-server holding hints for the prompt: the override on; without both: off);
- this process: the load. Capacity is the completed rate of a closed loop of `concurrency`
  clients; then open-loop Poisson arrivals at 50/80/100% of it. The overhead of a request is
  (send -> replica receipt through the router) minus the same measured straight to a replica at
  the same offered rate (two loopback hops and the stub's own parsing, which are not the router).

The prompt is `prompt_tokens` characters of text (the byte tokenizer: one token per character),
so the override's cost includes encoding, hashing the 125-block chain and one EVALSHA.
With `profile`, the router runs under cProfile at 80% with the override on and the top functions
by own time are reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_lab.fleet.bench import _pct, _wait_http
from kvfleet_lab.fleet.redis_servers import RedisNode
from kvfleet_lab.processes import free_port

__all__ = ["RouterCapacityReport", "bench_router_capacity", "serve_stub_replica"]

BENCH_KEY_FIELDS = ("bench-model", "sha256:" + "1" * 64, "float16", "rope", "sdpa")
TENANT = "bench"
LOOKUP_BUDGET_S = 0.05
"""The router's hint lookup budget here (2 ms in production): on a shared box a 2 ms budget skips
most lookups, and the figure wanted is what the override costs when it runs."""
API_KEY = "sk-bench"


def serve_stub_replica(port: int, name: str) -> None:
    """Process entry: a replica that answers at once, with a load report the override can use."""
    from aiohttp import web

    from kvfleet_lab.fleet.bench import _serve_forever
    from kvfleet_runtime.wire import LOAD_PATH, LoadReport

    report = LoadReport(ready=True, kv_occupancy=0.1, kv_capacity_tokens=1 << 20,
                        cache_key=BENCH_KEY_FIELDS, tokenizer="byte-v1").to_dict()
    report["name"] = name

    async def completions(request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        body = json.loads(await request.read())
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return web.json_response({"choices": [{"text": "ok"}],
                                  "hop_s": received - float(body["user"]),
                                  "via_port": peer[1] if peer else 0})

    async def load(request: web.Request) -> web.StreamResponse:
        return web.json_response(report)

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get(LOAD_PATH, load)
    _serve_forever(app, port)


@dataclass(slots=True)
class LevelResult:
    fraction: float
    offered_rps: float
    achieved_rps: float
    p50_overhead_s: float
    p99_overhead_s: float
    p50_direct_hop_s: float
    p99_direct_hop_s: float
    num_errors: int = 0
    upstream_connections: int = 0
    """Distinct router -> replica connections the level's requests arrived on."""
    redis_connections: int = 0
    """Connections Redis accepted during the level (the router's index, and this bench's own)."""


@dataclass(slots=True)
class ModeResult:
    override: bool
    capacity_rps: float
    levels: list[LevelResult] = field(default_factory=list)
    hint_lookups: int = 0
    """Lookups the router's index answered (from Redis' commandstats: EVALSHA calls)."""


@dataclass(slots=True)
class RouterCapacityReport:
    prompt_tokens: int
    concurrency: int
    seconds_per_level: float
    num_replicas: int
    modes: list[ModeResult] = field(default_factory=list)
    profile_top: list[tuple[str, float, float]] = field(default_factory=list)
    """(function, own seconds, cumulative seconds) of the router at 80% with the override."""
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@contextlib.contextmanager
def _child(args: list[str], *, ready: str | None = "READY",
           timeout_s: float = 60.0) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if ready is not None:
            assert proc.stdout is not None
            deadline = time.monotonic() + timeout_s
            line = ""
            while ready not in line:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"bench process did not start: {args[-1][:80]}")
                line = proc.stdout.readline()
        yield proc
    finally:
        # SIGINT: the router's web.run_app exits cleanly, so a cProfile wrapper writes its file.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _router_args(keys: Path, port: int, replicas: dict[str, int], redis_url: str | None,
                 profile_to: Path | None) -> list[str]:
    cli = ["router", "--keys", str(keys), "--port", str(port), "--log-level", "WARNING",
           "--poll-interval-s", "0.5"]
    for name, p in replicas.items():
        cli += ["--replica", f"{name}=http://127.0.0.1:{p}"]
    if redis_url is not None:
        cli += ["--redis-url", redis_url, "--recompute-s-per-token", "3.5e-5"]
    call = f"from kvfleet_runtime.cli import app; app({cli!r})"
    if profile_to is None:
        code = call
    else:
        # Profiled only between SIGUSR1 and SIGUSR2: the measured window, not the start-up.
        code = ("import cProfile, signal; p = cProfile.Profile()\n"
                "signal.signal(signal.SIGUSR1, lambda *_: p.enable())\n"
                "signal.signal(signal.SIGUSR2, lambda *_: (p.disable(), "
                f"p.dump_stats({str(profile_to)!r})))\n{call}")
    env_code = ("import os; os.environ['KVFLEET_ROUTER_SECRET'] = 'bench-router-secret'\n"
                f"os.environ['KVFLEET_HINT_LOOKUP_BUDGET_S'] = {str(LOOKUP_BUDGET_S)!r}\n")
    return [sys.executable, "-c", env_code + code]


async def _closed_loop(url: str, headers: dict[str, str], prompt: str, concurrency: int,
                       seconds: float) -> float:
    import aiohttp

    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            body = {"prompt": prompt, "max_tokens": 1, "user": repr(time.perf_counter())}
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
                if r.status == 200:
                    done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


async def _open_loop(url: str, headers: dict[str, str], prompt: str, rate: float,
                     seconds: float, seed: int) -> tuple[list[float], int, float, int]:
    """Poisson arrivals at `rate` for `seconds`: (send -> replica receipt per request, errors,
    achieved rate, distinct connections the replicas saw the requests on)."""
    import aiohttp

    rng = random.Random(seed)
    hops: list[float] = []
    via: set[int] = set()
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            nonlocal errors
            body = json.dumps({"prompt": prompt, "max_tokens": 1,
                               "user": repr(time.perf_counter())})
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    answer = await r.json()
                    if r.status != 200:
                        errors += 1
                        return
                    hops.append(float(answer["hop_s"]))
                    via.add(int(answer["via_port"]))
            except (aiohttp.ClientError, OSError, ValueError):
                errors += 1

        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        next_at = start
        while next_at < start + seconds:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return hops, errors, len(hops) / elapsed, len(via)


def _redis_connections(node: RedisNode) -> int:
    import redis

    with redis.Redis.from_url(node.url, socket_timeout=5) as client:
        return int(client.info("stats")["total_connections_received"])


def _evalsha_calls(node: RedisNode) -> int:
    import redis

    with redis.Redis.from_url(node.url, socket_timeout=5) as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _publish_prompt_hints(redis_url: str, prompt_tokens: int, replicas: list[str]) -> None:
    """The prompt's chain held by one replica, as its publisher would have said."""
    from kvfleet_runtime.cache import CacheKey, block_hashes
    from kvfleet_runtime.fleet.hint_index import RedisHintIndex
    from kvfleet_runtime.tokenizer import ByteTokenizer

    key = CacheKey(TENANT, *BENCH_KEY_FIELDS)
    hashes = block_hashes(key, ByteTokenizer().encode(_prompt(prompt_tokens)))

    async def publish() -> None:
        index = RedisHintIndex.from_url(redis_url, write_timeout_s=10.0)
        await index.publish(replicas[-1], hashes, tenant=TENANT)
        await index.close()

    asyncio.run(publish())


def _prompt(num_tokens: int) -> str:
    rng = random.Random(7)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(num_tokens))


def _profile_top(path: Path, n: int = 15) -> list[tuple[str, float, float]]:
    import pstats

    stats = pstats.Stats(str(path))
    rows = []
    for (file, line, func), (_cc, _nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((f"{Path(file).name}:{line}:{func}", tt, ct))
    rows.sort(key=lambda r: -r[1])
    return rows[:n]


def bench_router_capacity(
    *,
    prompt_tokens: int = 2000,
    concurrency: int = 32,
    seconds_per_level: float = 5.0,
    fractions: tuple[float, ...] = (0.5, 0.8, 1.0),
    num_replicas: int = 4,
    profile: bool = True,
) -> RouterCapacityReport:
    report = RouterCapacityReport(prompt_tokens, concurrency, seconds_per_level, num_replicas)
    prompt = _prompt(prompt_tokens)
    names = [f"r{i}" for i in range(num_replicas)]
    ports = {name: free_port() for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text(json.dumps({"tenants": {TENANT: [API_KEY]}}))
        redis = RedisNode(free_port(), Path(tmp) / "redis")
        redis.start()
        try:
            with contextlib.ExitStack() as stubs:
                for name, port in ports.items():
                    code = ("from kvfleet_lab.fleet.router_capacity import serve_stub_replica; "
                            f"serve_stub_replica({port}, {name!r})")
                    stubs.enter_context(_child([sys.executable, "-c", code]))
                _publish_prompt_hints(redis.url, prompt_tokens, names)
                for override in (False, True):
                    report.modes.append(_bench_mode(
                        override, keys, ports, redis, prompt, report, fractions,
                        Path(tmp) / "router.prof" if profile and override else None))
        finally:
            redis.kill()
    report.load_average = os.getloadavg()
    return report


def _bench_mode(override: bool, keys: Path, ports: dict[str, int], redis: RedisNode, prompt: str,
                report: RouterCapacityReport, fractions: tuple[float, ...],
                profile_to: Path | None) -> ModeResult:
    router_port = free_port()
    routed = f"http://127.0.0.1:{router_port}/v1/completions"
    direct = f"http://127.0.0.1:{next(iter(ports.values()))}/v1/completions"
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    plain = {"X-Kvfleet-Tenant": TENANT, "Content-Type": "application/json"}
    seconds = report.seconds_per_level
    with _child(_router_args(keys, router_port, ports, redis.url if override else None, None),
                ready=None):
        asyncio.run(_wait_http(f"http://127.0.0.1:{router_port}/readyz"))
        asyncio.run(_closed_loop(routed, auth, prompt, 4, 1.0))  # warm: view, script, pools
        capacity = asyncio.run(_closed_loop(routed, auth, prompt, report.concurrency, seconds))
    mode = ModeResult(override, capacity)
    before = _evalsha_calls(redis)
    for fraction in fractions:
        # A fresh router per level (under cProfile at 80% with the override, when asked).
        prof = profile_to if fraction == 0.8 else None
        with _child(_router_args(keys, router_port, ports, redis.url if override else None, prof),
                    ready=None) as router:
            asyncio.run(_wait_http(f"http://127.0.0.1:{router_port}/readyz"))
            asyncio.run(_closed_loop(routed, auth, prompt, 4, 1.0))
            rate = capacity * fraction
            if prof is not None:
                router.send_signal(signal.SIGUSR1)
            redis_before = _redis_connections(redis)
            hops, errors, achieved, upstream_connections = asyncio.run(
                _open_loop(routed, auth, prompt, rate, seconds, seed=1))
            redis_connections = _redis_connections(redis) - redis_before
            if prof is not None:
                router.send_signal(signal.SIGUSR2)
                deadline = time.monotonic() + 10
                while not prof.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        direct_hops, _, _, _ = asyncio.run(
            _open_loop(direct, plain, prompt, rate, seconds, seed=1))
        base50, base99 = _pct(direct_hops, 0.5), _pct(direct_hops, 0.99)
        mode.levels.append(LevelResult(
            fraction, rate, achieved,
            max(0.0, _pct(hops, 0.5) - base50), max(0.0, _pct(hops, 0.99) - base99),
            base50, base99, errors, upstream_connections, redis_connections))
        if prof is not None and prof.exists():
            report.profile_top = _profile_top(prof)
    mode.hint_lookups = _evalsha_calls(redis) - before
    return mode


def result_rows(report: RouterCapacityReport) -> list[dict[str, Any]]:
    return [
        {"override": m.override, "capacity_rps": m.capacity_rps, **asdict(level)}
        for m in report.modes for level in m.levels
    ]
