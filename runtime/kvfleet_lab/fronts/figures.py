"""`kvfleet bench fronts`, the pure parts: the clients' results and the servers' metrics read back
into one row per run, repeats folded into medians, and the comparison against issue 42's targets
(kvfleet's front caches at least every peer's prompt tokens, its TTFT p50 is at most 0.9x the best
peer's, its decision p99 under 2 ms)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvfleet_lab.vllm.serve_bench import parse_metrics

__all__ = ["KVFLEET_FRONT", "TARGET_DECISION_P99_MS", "TARGET_TTFT_RATIO", "RunRow",
           "comparison", "histogram_quantile", "medians", "merge_clients", "percentile",
           "requests_by_replica"]

KVFLEET_FRONT = "kvfleet-router"
TARGET_TTFT_RATIO = 0.9
TARGET_DECISION_P99_MS = 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` (0..100) percentile, linear between the two nearest ranks (numpy's default)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def histogram_quantile(metrics_text: str, name: str, q: float) -> float | None:
    """Prometheus' `histogram_quantile(q, name)` over one scrape (`q` in 0..1): linear within
    the bucket holding the rank; None without observations."""
    buckets: list[tuple[float, float]] = []
    for sample, labels, value in parse_metrics(metrics_text):
        if sample == name + "_bucket" and "le" in labels:
            buckets.append((float(labels["le"]), value))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 0.0)
        prev_le, prev_count = le, count
    return prev_le


def requests_by_replica(before: Mapping[str, float], after: Mapping[str, float]
                        ) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in sorted(after)}


@dataclass(frozen=True, slots=True)
class RunRow:
    """One front, one tenancy, one workload: every client's requests together."""

    front: str
    num_tenants: int
    workload: str
    num_requests: int
    num_failed: int
    prompt_tokens: float
    cached_tokens: float
    """Prompt tokens served from the replicas' prefix caches (vLLM's `local_cache_hit`)."""
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_throughput: float
    """Output tokens per second, all clients together."""
    decision_p50_ms: float | None = None
    decision_p99_ms: float | None = None
    requests_per_replica: dict[str, float] = field(default_factory=dict)

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cached_fraction"] = self.cached_fraction
        return out


def merge_clients(results: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Concurrent clients' `--save-result --save-detailed` JSON as one run: TTFT percentiles
    over every request of every client (exact), throughputs and counts added."""
    ttfts_ms = [1000.0 * t for r in results for t in r.get("ttfts", ()) if t is not None and t > 0]
    completed = sum(int(r["completed"]) for r in results)
    if completed < 1 or not ttfts_ms:
        raise ValueError(f"the clients completed {completed} requests")
    return {"completed": completed,
            "failed": sum(int(r.get("failed", 0)) for r in results),
            "ttft_p50_ms": percentile(ttfts_ms, 50), "ttft_p99_ms": percentile(ttfts_ms, 99),
            "output_throughput": sum(float(r["output_throughput"]) for r in results)}


def medians(rows: Sequence[RunRow]) -> list[RunRow]:
    """Repeats of a (front, tenancy, workload) folded into one row of medians (the first
    repeat's replica split), in first-seen order."""
    groups: dict[tuple[str, int, str], list[RunRow]] = {}
    for r in rows:
        groups.setdefault((r.front, r.num_tenants, r.workload), []).append(r)
    out = []
    for same in groups.values():
        def med(attr: str, same: list[RunRow] = same) -> Any:
            values = [getattr(r, attr) for r in same if getattr(r, attr) is not None]
            return statistics.median(values) if values else None
        out.append(replace(same[0], **{a: med(a) for a in (
            "num_requests", "num_failed", "prompt_tokens", "cached_tokens", "ttft_p50_ms",
            "ttft_p99_ms", "output_throughput", "decision_p50_ms", "decision_p99_ms")}))
    return out


def comparison(rows: Sequence[RunRow], ours: str = KVFLEET_FRONT) -> dict[str, Any]:
    """Per tenancy and workload: our cached tokens / the best peer's (target >= 1), our TTFT
    p50 / the best peer's (target <= 0.9), our decision p99 (target < 2 ms). `ours` is one of
    kvfleet's fronts (the router, or the EPP behind Envoy); the peers are the others'."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r.num_tenants, r.workload) for r in rows):
        same = [r for r in rows if (r.num_tenants, r.workload) == key]
        mine = next((r for r in same if r.front == ours), None)
        # the field's fronts: kvfleet's other front is not a peer
        peers = [r for r in same if not r.front.startswith("kvfleet-")]
        if mine is None or not peers:
            continue
        best_cached = max(peers, key=lambda r: r.cached_tokens)
        best_ttft = min(peers, key=lambda r: r.ttft_p50_ms)
        cached_ratio = (mine.cached_tokens / best_cached.cached_tokens
                        if best_cached.cached_tokens else None)
        ttft_ratio = mine.ttft_p50_ms / best_ttft.ttft_p50_ms if best_ttft.ttft_p50_ms else None
        out[f"{key[0]} tenant(s) / {key[1]}"] = {
            "best_peer_cached": best_cached.front, "cached_vs_best_peer": cached_ratio,
            "best_peer_ttft_p50": best_ttft.front, "ttft_p50_vs_best_peer": ttft_ratio,
            "decision_p99_ms": mine.decision_p99_ms,
            "targets_met": {
                "cached": cached_ratio is not None and cached_ratio >= 1.0,
                "ttft_p50": ttft_ratio is not None and ttft_ratio <= TARGET_TTFT_RATIO,
                "decision_p99": (mine.decision_p99_ms is not None
                                 and mine.decision_p99_ms < TARGET_DECISION_P99_MS)}}
    return out
