"""What the router knows about the fleet: the published config (watched), the replicas, their
last load reports, and its own requests in flight.

Replica load protocol: `GET {replica}{LOAD_PATH}` answers a load report (its schema:
`kvfleet_runtime.wire`). A replica without that route (404) is judged by `GET /readyz` alone
(load unknown = 0); a vLLM replica (the fleet config's `engine`) by vLLM's `GET /health`, its
load from vLLM's own gauges on `GET /metrics` (`vllm_load_report`). A replica that does not
answer within the poll timeout is not ready until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kvfleet_runtime.affinity import ReplicaLoad, bounded_home_sets, home_sets
from kvfleet_runtime.config.fleet import FleetConfig, ReplicaEndpoint, next_fleet_config
from kvfleet_runtime.config.watch import ConfigFileWatcher
from kvfleet_runtime.wire import LOAD_PATH, Engine, LoadReport, parse_load_report

__all__ = ["FleetView", "vllm_load_report"]

log = logging.getLogger(__name__)

HOME_SET_MEMO = 65_536
"""Tenants whose rendezvous choices the router keeps (oldest dropped first): ~100 bytes each."""
BOUNDED_HOMES_MAX_PAIRS = 1 << 18
"""Known tenants x replicas up to which the first homes are planned whole (`bounded_home_sets`,
one sha256 per pair: ~0.2 s at this size); past it, plain rendezvous per tenant, whose first
homes even out over many tenants per replica."""

@dataclass(slots=True)
class _Replica:
    name: str
    url: str
    engine: Engine = "kvfleet"
    report: LoadReport | None = None
    inflight: int = 0
    inflight_tokens: int = 0
    down_until: float = 0.0
    """`time.monotonic()` before which the replica is out of decisions whatever it reports."""


@dataclass
class FleetView:
    """Replicas, config and loads. `static_replicas` (flags) are used when no config file is
    given or the file lists no replicas; the config's home sets are used when it has them,
    else the router computes rendezvous home sets itself."""

    static_replicas: Mapping[str, str] = field(default_factory=dict)
    config_path: Path | None = None
    k: int = 3
    occupancy_threshold: float = 0.85
    recompute_s_per_token: float | None = None
    service_s_per_request: float = 0.05
    """Added to a replica's queue delay per request this router has in flight there."""
    config: FleetConfig | None = None
    config_errors: int = 0
    replicas: dict[str, _Replica] = field(default_factory=dict)
    on_change: Callable[[], None] | None = None

    tenants: frozenset[str] = frozenset()
    """The tenants the router knows (its API keys): their first homes are spread
    (`bounded_home_sets`) while the fleet is small enough to plan whole."""

    _watcher: ConfigFileWatcher | None = field(default=None, init=False, repr=False)
    _homes: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False)
    _bounded: dict[str, tuple[str, ...]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Before the first load (see ConfigFileWatcher): a write in between is seen, not missed.
        if self.config_path is not None:
            self._watcher = ConfigFileWatcher(self.config_path)
        self._apply()

    # -- config ------------------------------------------------------------------------------

    @property
    def config_error(self) -> str:
        """Why the fleet config file on disk is not in force ("" when it is)."""
        return self._watcher.error if self._watcher is not None else ""

    def reload_config(self, content: bytes | None = None) -> bool:
        """Load the config (`content`: what the watcher read, else the file); on a parse error,
        or a config that drops the generation in force (`check_successor`), keep the last good
        config. True if applied. Parses on the calling thread (`reload_config_async` from the
        event loop)."""
        if self.config_path is None:
            return False
        return self._install(next_fleet_config(self.config_path, content, self.config,
                                               self._watcher), content)

    async def reload_config_async(self, content: bytes | None = None) -> bool:
        """`reload_config` with the parse on a worker thread (a file at the parser's bounds
        takes a while to refuse) and the change applied on the event loop."""
        if self.config_path is None:
            return False
        new = await asyncio.to_thread(next_fleet_config, self.config_path, content, self.config,
                                      self._watcher)
        return self._install(new, content)

    def _install(self, new: FleetConfig | None, content: bytes | None) -> bool:
        watcher = self._watcher
        if new is None:
            self.config_errors += 1
            return False
        if new != self.config:
            self.config = new
            self._apply()
        if content is not None and watcher is not None:
            watcher.accept(content)
        return True

    def _endpoints(self) -> dict[str, tuple[str, Engine]]:
        """name -> (url, engine); replicas given by flags are kvfleet replicas."""
        if self.config is not None and self.config.replicas:
            return {r.name: (r.url, r.engine) for r in self.config.replicas if _usable(r)}
        return {name: (url, "kvfleet") for name, url in self.static_replicas.items()}

    def _apply(self) -> None:
        endpoints = self._endpoints()
        self._homes.clear()  # replicas or k may have changed
        self._bounded = None
        for name in list(self.replicas):
            if name not in endpoints:
                del self.replicas[name]
        for name, (url, engine) in endpoints.items():
            current = self.replicas.get(name)
            if current is None or current.url != url.rstrip("/") or current.engine != engine:
                self.replicas[name] = _Replica(name, url.rstrip("/"), engine)
        if self.on_change is not None:
            self.on_change()

    @property
    def affinity_k(self) -> int:
        return self.config.affinity.k if self.config is not None else self.k

    @property
    def threshold(self) -> float:
        if self.config is not None:
            return self.config.affinity.occupancy_threshold
        return self.occupancy_threshold

    @property
    def recompute_cost(self) -> float | None:
        if self.config is not None and self.config.recompute_s_per_token is not None:
            return self.config.recompute_s_per_token
        return self.recompute_s_per_token

    @property
    def t2_enabled(self) -> bool:
        return self.config is None or self.config.tiers.t2_peer

    def set_tenants(self, tenants: frozenset[str]) -> None:
        if tenants != self.tenants:
            self.tenants = tenants
            self._bounded = None

    def home_set(self, tenant: str) -> tuple[str, ...] | None:
        """`tenant`'s home set as the config pins it; for a known tenant of a small fleet its
        bounded home set (first home spread, then `2k - 1` rendezvous choices); else its first
        `2k` rendezvous choices over the config's replicas, memoized until the replica list
        changes (None without replicas).

        The decision takes the first k of these that are ready, and ranks every ready replica only
        when fewer than k are, so the result is the rendezvous top k over the ready replicas
        either way; what the memo saves is one sha256 per replica per request (~1 ms at 1,000
        replicas, where the published config no longer lists home sets)."""
        if self.config is not None and tenant in self.config.home_sets:
            return self.config.home_sets[tenant]
        if tenant in self.tenants and self.replicas:
            if self._bounded is None:
                small = len(self.tenants) * len(self.replicas) <= BOUNDED_HOMES_MAX_PAIRS
                self._bounded = (bounded_home_sets(self.tenants, sorted(self.replicas),
                                                   2 * self.affinity_k) if small else {})
            if tenant in self._bounded:
                return self._bounded[tenant]
        cached = self._homes.get(tenant)
        if cached is None:
            if not self.replicas:
                return None
            cached = home_sets([tenant], sorted(self.replicas), 2 * self.affinity_k)[tenant]
            if len(self._homes) >= HOME_SET_MEMO:
                self._homes.pop(next(iter(self._homes)))
            self._homes[tenant] = cached
        return cached

    def computed_home_sets(self, tenants: list[str]) -> dict[str, tuple[str, ...]]:
        return home_sets(tenants, sorted(self.replicas), self.affinity_k)

    # -- loads -------------------------------------------------------------------------------

    def loads(self) -> list[ReplicaLoad]:
        """Decision inputs: the last report of each replica plus this router's own in-flight
        requests (so a burst does not land on one replica between two reports)."""
        out = []
        now = time.monotonic()
        for r in self.replicas.values():
            rep = r.report
            if rep is not None and r.down_until > now:
                rep = dataclasses.replace(rep, ready=False)
            if rep is None:
                out.append(ReplicaLoad(r.name, 0.0, 0.0, ready=False, num_inflight=r.inflight))
                continue
            occupancy = rep.kv_occupancy
            if rep.kv_capacity_tokens:
                occupancy += r.inflight_tokens / rep.kv_capacity_tokens
            delay = rep.queue_delay_s + r.inflight * self.service_s_per_request
            out.append(ReplicaLoad(r.name, occupancy, delay, ready=rep.ready,
                                   num_inflight=r.inflight))
        return out

    def report(self, name: str) -> LoadReport | None:
        r = self.replicas.get(name)
        return None if r is None else r.report

    def begin(self, name: str, tokens: int) -> None:
        r = self.replicas.get(name)
        if r is not None:
            r.inflight += 1
            r.inflight_tokens += tokens

    def end(self, name: str, tokens: int) -> None:
        r = self.replicas.get(name)
        if r is not None:
            r.inflight = max(0, r.inflight - 1)
            r.inflight_tokens = max(0, r.inflight_tokens - tokens)

    def mark_down(self, name: str, backoff_s: float | None = None) -> None:
        """A proxied request could not reach the replica: not ready until its next report, or
        (`backoff_s`) for that long whatever its reports say (it took a request and did not
        answer, or answered garbage: its reports cannot be trusted for a while)."""
        r = self.replicas.get(name)
        if r is not None and backoff_s is not None:
            r.down_until = time.monotonic() + backoff_s
        if r is not None and r.report is not None:
            r.report = LoadReport(
                False,
                r.report.kv_occupancy,
                cache_key=r.report.cache_key,
                tokenizer=r.report.tokenizer,
            )

    async def poll_once(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        await asyncio.gather(
            *(self._poll(session, r, timeout_s) for r in list(self.replicas.values()))
        )

    async def _poll(self, session: aiohttp.ClientSession, r: _Replica, timeout_s: float) -> None:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            if r.engine == "vllm":
                # vLLM serves neither the load report nor /readyz: its /health is readiness, and
                # its own gauges on /metrics are the load (unknown, 0, when they do not answer).
                async with session.get(r.url + "/health", timeout=timeout) as resp:
                    r.report = LoadReport(ready=resp.status == 200)
                if r.report.ready:
                    async with session.get(r.url + "/metrics", timeout=timeout) as resp:
                        if resp.status == 200:
                            r.report = vllm_load_report(await resp.read())
                return
            async with session.get(r.url + LOAD_PATH, timeout=timeout) as resp:
                if resp.status == 200:
                    r.report = parse_load_report(await resp.json())
                    return
                if resp.status != 404:
                    r.report = LoadReport(ready=False)
                    return
            async with session.get(r.url + "/readyz", timeout=timeout) as resp:
                r.report = LoadReport(ready=resp.status == 200)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            log.debug("load poll of %s failed: %r", r.name, exc)
            r.report = LoadReport(ready=False)

    async def run(
        self, session: aiohttp.ClientSession, *, poll_interval_s: float, config_poll_s: float
    ) -> None:
        """Poll loads every `poll_interval_s` and the config file every `config_poll_s` (a change
        applies at the first poll that sees it whole: `config.watch`)."""
        loop = asyncio.get_running_loop()
        next_config = next_load = loop.time()
        while True:
            now = loop.time()
            if self._watcher is not None and now >= next_config:
                next_config = now + config_poll_s
                content = await asyncio.to_thread(self._watcher.poll)
                if content is not None:
                    await self.reload_config_async(content)
            if now >= next_load:
                next_load = now + poll_interval_s
                with contextlib.suppress(Exception):
                    await self.poll_once(session, timeout_s=max(0.05, min(poll_interval_s, 2.0)))
            due = next_load if self.config_path is None else min(next_load, next_config)
            await asyncio.sleep(max(0.01, due - loop.time()))


_VLLM_LOAD_GAUGES = (b"kv_cache_usage_perc", b"num_requests_waiting", b"num_requests_running")


def _samples(metrics: bytes, name: bytes) -> list[float]:
    """The values of `name`'s samples in Prometheus text. vLLM's /metrics is thousands of
    histogram lines: bytes.find skips to the few wanted ones (splitting the page line by line in
    Python, or a multiline regex, costs ~4 ms per poll for 256 KB)."""
    values = []
    text = b"\n" + metrics  # every line, the first included, follows a newline
    # OpenMetrics writes vLLM's `vllm:` names as `vllm_`; one page has one spelling
    prefix = b"vllm:" if b"\nvllm:" in text else b"vllm_"
    needle = b"\n" + prefix + name
    pos = text.find(needle)
    while pos >= 0:
        end = text.find(b"\n", pos + 1)
        line = text[pos + 1:] if end < 0 else text[pos + 1:end]
        if line[len(needle) - 1:len(needle)] in (b"{", b" "):  # not a longer name
            with contextlib.suppress(ValueError, IndexError):
                values.append(float(line.rsplit(b" ", 1)[1]))
        pos = -1 if end < 0 else text.find(needle, end)
    return values


def vllm_load_report(metrics: bytes) -> LoadReport:
    """A ready vLLM replica's load from its Prometheus text (`vllm:kv_cache_usage_perc`, a
    fraction, and the request gauges). With several engines (data parallel) the fullest engine's
    occupancy and the summed requests; NaN or negative samples are no load. vLLM reports no
    queue delay or token capacity: the router's own in-flight count stands in."""
    usage, waiting, running = (
        [v for v in _samples(metrics, name) if v >= 0] for name in _VLLM_LOAD_GAUGES)
    return LoadReport(ready=True, kv_occupancy=min(max(usage, default=0.0), 1.0),
                      num_waiting=int(sum(waiting)), num_running=int(sum(running)))


def _usable(r: ReplicaEndpoint) -> bool:
    return r.ready

