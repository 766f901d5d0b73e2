"""Where a rollout's hit rates come from: the Prometheus HTTP API, else the replicas themselves.

The default queries depend on what serves the Deployment (`DeploymentPods.engine`, from its pod
template's `kvfleet.dev/engine`): kvfleet replicas export kvfleet's cache counters; a vLLM
replica's T0 is vLLM's own prefix cache, so its hit rate adds vLLM's counters (`queries_for`).

Prometheus (`/api/v1/query`, instant queries from the ModelRollout's templates) gives windowed
rates. When it is not configured, unreachable or has no data, the fallback reads `GET /cache/stats`
on every ready pod of the Deployment and divides the summed matched tokens by the summed looked-up
tokens. Those counters are cumulative since each pod started; for a canary (whose pods are new)
that lags the instantaneous rate, so the fallback can only delay a promotion, never hasten one.
The pods are asked all at once, and the whole read has one budget (the source's timeout): a slow
or unreachable pod costs one timeout per read, not one per pod, and is skipped. The fallback
reads all tenants' totals, which replicas show only to the operator's token
(`kvfleet_runtime.auth`; the chart mounts it in the operator and the replicas).

The policy's NVMe measurement reads the replicas' load reports the same way (`read_nvme_reports`).
The operator reads both through a `BackOff` per replica (`NvmeReportReader`, `CacheStatsReader`),
so that pods known not to answer (a partitioned node; kwok's pods, which have an IP and no
endpoint) do not cost every reconcile the whole budget.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from string import Template
from typing import Any, TypeVar

from kvfleet_operator.api import (
    DEFAULT_HIT_RATE_QUERY,
    DEFAULT_SAVED_PREFILL_QUERY,
    CacheStatsSource,
    MetricsSpec,
    PrometheusSource,
)
from kvfleet_runtime.wire import Engine

__all__ = [
    "VLLM_HIT_RATE_QUERY",
    "VLLM_SAVED_PREFILL_QUERY",
    "BackOff",
    "CacheStatsReader",
    "DeploymentPods",
    "MetricReading",
    "NvmeReportReader",
    "ReadStats",
    "pod_regex",
    "prometheus_query",
    "queries_for",
    "read_cache_stats",
    "read_hit_rates",
    "read_nvme_reports",
    "render_query",
    "stats_url",
]

# A vLLM replica's hit rate: vLLM's own prefix cache (T0; tokens, of every prompt token it was
# asked about) plus the tokens kvfleet's connector loaded beyond vLLM's hit, over vLLM's queries.
# The connector counts only tokens beyond vLLM's own hit, so no token is counted twice. The
# connector's per-tenant series appear with a tenant's first request through it: `or vector(0)`
# keeps the T0 share on a replica where none exists yet (no request, or every one bypassed the
# connector), because a sum over no series is no sample, and `x + nothing` is nothing.
# vLLM names its counters `vllm:...`, but prometheus_client's OpenMetrics exposition (which
# Prometheus 2.x asks for first) writes the samples as `vllm_...`: the regex takes either.
_VLLM_HIT_TOKENS = (
    'sum(rate({__name__=~"vllm[:_]prefix_cache_hits_total",namespace="${namespace}",'
    'pod=~"${pod_regex}"}[$w])) + (sum(rate(kvfleet_cache_matched_tokens_total{'
    'namespace="${namespace}",pod=~"${pod_regex}"}[$w])) or vector(0))'
)
VLLM_HIT_RATE_QUERY = (
    "(" + _VLLM_HIT_TOKENS.replace("$w", "1m") + ") / sum(rate({__name__=~"
    '"vllm[:_]prefix_cache_queries_total",namespace="${namespace}",pod=~"${pod_regex}"}[1m]))'
)
VLLM_SAVED_PREFILL_QUERY = _VLLM_HIT_TOKENS.replace("$w", "5m")

# Threads of one `/cache/stats` read: a Deployment of up to this many ready pods is asked at once
# (a larger one in rounds, within the same budget).
MAX_STATS_READERS = 32


@dataclass(frozen=True, slots=True)
class DeploymentPods:
    namespace: str
    deployment: str
    pod_ips: tuple[str, ...]
    """Ready pods, for the `/cache/stats` fallback."""
    pod_names: tuple[str, ...] = ()
    """Every pod of the Deployment (and track) that exists now, ready or not, for Prometheus."""
    engine: Engine = "kvfleet"
    """What its pod template says serves it (`kvfleet.dev/engine`): picks the default queries."""


@dataclass(frozen=True, slots=True)
class MetricReading:
    target_hit_rate: float | None
    canary_hit_rate: float | None
    target_saved_prefill_tokens_per_s: float | None
    source: str


def pod_regex(pod_names: Sequence[str]) -> str:
    """A PromQL regex matching exactly these pods. Exact names, not `<deployment>-.*`: the series
    of a deleted pod stay in a rate window for a minute, so a pattern would judge a new canary
    partly on the previous rollout's canary (same Deployment name, gone pods)."""
    return "|".join(name.replace(".", "\\\\.") for name in sorted(pod_names))


def render_query(template: str, pods: DeploymentPods) -> str:
    return Template(template).safe_substitute(
        namespace=pods.namespace, deployment=pods.deployment, pod_regex=pod_regex(pods.pod_names)
    )


def queries_for(source: PrometheusSource, engine: Engine) -> tuple[str, str]:
    """(hit-rate, saved-prefill) templates for a Deployment served by `engine`. A ModelRollout
    that left a query at its default (the CRD fills kvfleet's in) gets vLLM's for vLLM replicas,
    whose T0 hits only vLLM's own counters see; a query the user wrote is used as written."""
    hit, saved = source.hit_rate_query, source.saved_prefill_query
    if engine == "vllm":
        hit = VLLM_HIT_RATE_QUERY if hit == DEFAULT_HIT_RATE_QUERY else hit
        saved = VLLM_SAVED_PREFILL_QUERY if saved == DEFAULT_SAVED_PREFILL_QUERY else saved
    return hit, saved


def prometheus_query(source: PrometheusSource, query: str) -> float | None:
    """The first sample of an instant query; None when there is no sample or it is NaN.
    Raises OSError when Prometheus cannot be reached or answers with an error."""
    url = source.url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=source.timeout_seconds) as response:
        body: dict[str, Any] = json.loads(response.read())
    if body.get("status") != "success":
        raise OSError(f"prometheus query failed: {body.get('error', body)}")
    result = body.get("data", {}).get("result", [])
    if not result:
        return None
    value = result[0].get("value", [None, "NaN"])[1]
    number = float(value)
    return None if math.isnan(number) or math.isinf(number) else number


def _pod_totals(
    source: CacheStatsSource, token: bytes | None, url: str, timeout_s: float
) -> tuple[int, int]:
    """(matched, looked-up) tokens of one pod. Raises OSError or ValueError when it does not
    answer, refuses (a missing or wrong `token`: 401) or answers garbage."""
    headers = {"Authorization": "Bearer " + token.decode()} if token else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        data: dict[str, Any] = json.loads(response.read())
    totals = data.get("totals") or {}
    return int(totals.get("num_matched_tokens", 0)), int(totals.get("num_lookup_tokens", 0))


def stats_url(source: CacheStatsSource, ip: str) -> str:
    return f"http://{ip}:{source.port}{source.path}"


def _hit_rate(results: Sequence[tuple[str, object]]) -> float | None:
    """Summed matched over summed looked-up tokens of the pods that answered; pods that did not
    (an error or no answer in time: OSError, ValueError) are skipped, any other error raised."""
    matched = looked_up = 0
    answered = False
    for _, result in results:
        if isinstance(result, OSError | ValueError):
            continue  # an unreachable pod, or one that answered garbage
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, tuple)
        matched += result[0]
        looked_up += result[1]
        answered = True
    if not answered or looked_up == 0:
        return None
    return matched / looked_up


def read_cache_stats(
    source: CacheStatsSource, pod_ips: Sequence[str], token: bytes | None = None
) -> float | None:
    """Hit rate over the pods' cumulative token counters. Every pod is asked concurrently (with
    the operator `token`) and the read returns after at most `source.timeout_seconds` in all;
    pods that have not answered by then, or answered an error (a refused token included), are
    skipped (their requests finish in the background, bounded by the same timeout)."""
    fetch = functools.partial(_pod_totals, source, token)
    urls = [stats_url(source, ip) for ip in pod_ips]
    return _hit_rate(_ask_all(urls, source.timeout_seconds, fetch))


def _pod_nvme(url: str, timeout_s: float) -> dict[str, Any] | None:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data: dict[str, Any] = json.loads(response.read())
    nvme = data.get("nvme")
    if not isinstance(nvme, dict) or not isinstance(nvme.get("read_bandwidth"), dict):
        return None
    return dict(nvme["read_bandwidth"])


NvmeFetch = Callable[[str, float], dict[str, Any] | None]
"""One replica's load-report URL and a timeout -> its T3 read-bandwidth section (None: no T3);
raises OSError or ValueError when the replica does not answer or answers garbage."""

T = TypeVar("T")


def _ask_all(
    urls: Sequence[str], timeout_s: float, fetch: Callable[[str, float], T]
) -> list[tuple[str, T | BaseException]]:
    """Every URL asked concurrently within one total budget: (url, its answer) or the error (a
    `TimeoutError` for those that had not answered when the budget ran out)."""
    if not urls:
        return []
    pool = ThreadPoolExecutor(
        max_workers=min(len(urls), MAX_STATS_READERS), thread_name_prefix="replica-reads"
    )
    try:
        futures = [(url, pool.submit(fetch, url, timeout_s)) for url in urls]
        wait([f for _, f in futures], timeout=timeout_s)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    out: list[tuple[str, T | BaseException]] = []
    for url, future in futures:
        if not future.done():
            out.append((url, TimeoutError(f"{url}: no answer within {timeout_s} s")))
        elif (error := future.exception()) is not None:
            out.append((url, error))
        else:
            out.append((url, future.result()))
    return out


def read_nvme_reports(
    urls: Sequence[str], timeout_s: float = 2.0, fetch: NvmeFetch = _pod_nvme
) -> list[dict[str, Any]]:
    """The T3 read-bandwidth sections of the replicas' load reports (`GET /fleet/v1/load`),
    asked concurrently within one total budget; replicas without T3, slow or unreachable ones
    are skipped (the decision then rests on fewer replicas, or on the profile)."""
    return [r for _, r in _ask_all(urls, timeout_s, fetch) if isinstance(r, dict)]


@dataclass(slots=True)
class _Silent:
    failures: int
    retry_at_s: float


class BackOff:
    """Which replica URLs did not answer, per object that reads them, and until when to skip
    them: one that failed (no answer within the budget, a refused connection, garbage) is not
    asked again for `base_backoff_s`, doubling with each further failure up to `max_backoff_s`;
    one answer clears it. Each object's entries are only its replicas of its last read (one that
    left the fleet is forgotten), and `forget` drops an object's entries (it was deleted): the
    map stays as large as the fleets of the objects that exist. Thread-safe (kopf runs handlers
    in threads)."""

    def __init__(
        self,
        base_backoff_s: float = 10.0,
        max_backoff_s: float = 300.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < base_backoff_s <= max_backoff_s, got {base_backoff_s}, {max_backoff_s}"
            )
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._silent: dict[Hashable, dict[str, _Silent]] = {}
        self._lock = threading.Lock()

    def skipped(self, urls: Sequence[str], owner: Hashable = None) -> list[str]:
        """Those of `urls` that are backing off now for `owner` (not asked by its next read)."""
        now = self._clock()
        with self._lock:
            silent = self._silent.get(owner, {})
            return [u for u in urls if (s := silent.get(u)) is not None and now < s.retry_at_s]

    def record(
        self, urls: Sequence[str], results: Sequence[tuple[str, object]], owner: Hashable = None
    ) -> None:
        """`owner`'s read of `urls` got `results` (an exception for those that failed)."""
        now = self._clock()
        with self._lock:
            old = self._silent.get(owner, {})
            wanted = set(urls)
            silent = {u: s for u, s in old.items() if u in wanted}
            for url, result in results:
                if not isinstance(result, BaseException):
                    silent.pop(url, None)
                    continue
                before = silent.get(url)
                failures = 1 if before is None else before.failures + 1
                delay_s = min(self.base_backoff_s * 2 ** min(failures - 1, 30), self.max_backoff_s)
                silent[url] = _Silent(failures, now + delay_s)
            if silent:
                self._silent[owner] = silent
            else:
                self._silent.pop(owner, None)

    def forget(self, owner: Hashable) -> None:
        with self._lock:
            self._silent.pop(owner, None)

    def __len__(self) -> int:
        """The objects with a replica backing off now."""
        with self._lock:
            return len(self._silent)


class NvmeReportReader:
    """`read_nvme_reports` with a `BackOff`: replicas known not to answer are not asked.
    Callable as a `handlers.ReadNvme` (bind `owner` to tell the policies' fleets apart)."""

    def __init__(
        self,
        timeout_s: float = 2.0,
        base_backoff_s: float = 10.0,
        max_backoff_s: float = 300.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        fetch: NvmeFetch = _pod_nvme,
    ) -> None:
        self.backoff = BackOff(base_backoff_s, max_backoff_s, clock=clock)
        self.timeout_s = timeout_s
        self._fetch = fetch

    def skipped(self, urls: Sequence[str], owner: Hashable = None) -> list[str]:
        return self.backoff.skipped(urls, owner)

    def __call__(self, urls: Sequence[str], owner: Hashable = None) -> list[dict[str, Any]]:
        skipped = set(self.backoff.skipped(urls, owner))
        results = _ask_all([u for u in urls if u not in skipped], self.timeout_s, self._fetch)
        self.backoff.record(urls, results, owner)
        return [r for _, r in results if isinstance(r, dict)]


StatsFetch = Callable[[CacheStatsSource, bytes | None, str, float], tuple[int, int]]


class CacheStatsReader:
    """`read_cache_stats` with a `BackOff`: pods that never answer (a partitioned node, an IP
    with no endpoint) stop costing every rollout evaluation the whole budget. Callable as a
    `ReadStats` (bind `owner` to tell the rollouts apart)."""

    def __init__(
        self,
        base_backoff_s: float = 10.0,
        max_backoff_s: float = 300.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        fetch: StatsFetch = _pod_totals,
    ) -> None:
        self.backoff = BackOff(base_backoff_s, max_backoff_s, clock=clock)
        self._fetch = fetch

    def __call__(
        self,
        source: CacheStatsSource,
        pod_ips: Sequence[str],
        token: bytes | None = None,
        owner: Hashable = None,
    ) -> float | None:
        urls = [stats_url(source, ip) for ip in pod_ips]
        skipped = set(self.backoff.skipped(urls, owner))
        fetch = functools.partial(self._fetch, source, token)
        asked = [u for u in urls if u not in skipped]
        results = _ask_all(asked, source.timeout_seconds, fetch)
        self.backoff.record(urls, results, owner)
        return _hit_rate(results)


ReadStats = Callable[[CacheStatsSource, Sequence[str], bytes | None], float | None]
"""A `/cache/stats` fallback read: the source, the ready pods' IPs, the operator token."""


def _hit_rate_bounded(rate: float | None) -> float | None:
    """A hit rate read from Prometheus, within [0, 1]. The query divides two windowed `rate()`s,
    and Prometheus extrapolates each counter to the window's edges on its own (a young series,
    a pod started within the window, is extrapolated only back to where it would be zero, which
    differs between the matched and the looked-up counter): near a full hit rate the quotient
    comes out a little above 1 (a BASELINE of "100.2%"), which no cache can do."""
    return None if rate is None else min(1.0, max(0.0, rate))


def read_hit_rates(
    spec: MetricsSpec,
    target: DeploymentPods,
    canary: DeploymentPods | None,
    *,
    token: bytes | None = None,
    read_stats: ReadStats = read_cache_stats,
) -> MetricReading:
    """`token`: the operator token the `/cache/stats` fallback presents; `read_stats`: how it
    reads (a `CacheStatsReader` to skip pods that do not answer)."""
    prometheus = spec.prometheus
    if prometheus is not None:
        try:

            def ask(which: int, pods: DeploymentPods) -> float | None:
                if not pods.pod_names:
                    return None  # no pods: nothing of theirs to measure (and no empty regex)
                template = queries_for(prometheus, pods.engine)[which]
                return prometheus_query(prometheus, render_query(template, pods))

            target_rate = _hit_rate_bounded(ask(0, target))
            canary_rate = None if canary is None else _hit_rate_bounded(ask(0, canary))
            saved = ask(1, target)
            if target_rate is not None or canary_rate is not None or not spec.cache_stats.enabled:
                return MetricReading(target_rate, canary_rate, saved, "prometheus")
        except (OSError, ValueError) as exc:
            if not spec.cache_stats.enabled:
                return MetricReading(None, None, None, f"prometheus unavailable: {exc}"[:200])
    stats = spec.cache_stats
    return MetricReading(
        read_stats(stats, target.pod_ips, token),
        None if canary is None else read_stats(stats, canary.pod_ips, token),
        None,
        "cache-stats",
    )
