"""What a run measured: hit rate, prefill saved, TTFT percentiles, over a window or over time."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvfleet_lab.simulate._engine import TIER_MISS, TIER_NVME, SimResult


@dataclass(frozen=True, slots=True)
class Metrics:
    start_s: float
    end_s: float
    num_requests: int
    hit_rate: float
    """Token-weighted share of prefix tokens served from a cache tier."""
    template_hit_rate: float
    """Share of reusable-prefix requests whose prefix was resident where they landed: the
    coverage the routing policy achieves."""
    saved_tokens_per_s: float
    replicas_saved: float
    computed_tokens_per_s: float
    computed_replicas: float
    """Prefill the fleet actually ran, in replica-equivalents of compute."""
    ttft_p50_s: float
    ttft_p99_s: float
    spill_rate: float
    mean_fetch_s: float | None
    fetch_bytes_per_s: float | None
    """Achieved bandwidth of a fetch: prefix bytes / fetch time, averaged over hits."""
    nvme_hit_rate: float
    nvme_fetch_bytes_per_s: float | None
    """The same, over the hits served from NVMe only (shared by concurrent fetches, R6)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(result: SimResult, start_s: float, end_s: float) -> Metrics:
    """Metrics of the requests that arrived in [start_s, end_s)."""
    wl, prof = result.config.workload, result.config.profile
    sel = (result.arrival_s >= start_s) & (result.arrival_s < end_s)
    count = int(sel.sum())
    if count == 0:
        raise ValueError(f"no request arrived in [{start_s}, {end_s}) s")
    span_s = end_s - start_s
    hits = result.tier[sel] != TIER_MISS
    num_hits = int(hits.sum())
    templates = result.is_template[sel]
    saved = num_hits * wl.prefix_tokens / span_s
    computed = (count * wl.suffix_tokens + (count - num_hits) * wl.prefix_tokens) / span_s
    ttft = result.ttft_s[sel]
    fetch = result.fetch_s[sel][hits]
    prefix_bytes = wl.prefix_tokens * prof.kv_bytes_per_token
    nvme = result.tier[sel] == TIER_NVME
    nvme_fetch = result.fetch_s[sel][nvme]
    return Metrics(
        start_s=start_s,
        end_s=end_s,
        num_requests=count,
        hit_rate=num_hits / count,
        template_hit_rate=float(hits[templates].mean()) if templates.any() else 0.0,
        saved_tokens_per_s=saved,
        replicas_saved=saved * prof.recompute_s_per_token,
        computed_tokens_per_s=computed,
        computed_replicas=computed * prof.recompute_s_per_token,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        spill_rate=float(result.spilled[sel].mean()),
        mean_fetch_s=float(fetch.mean()) if num_hits else None,
        fetch_bytes_per_s=float((prefix_bytes / fetch).mean()) if num_hits else None,
        nvme_hit_rate=float(nvme.mean()),
        nvme_fetch_bytes_per_s=float((prefix_bytes / nvme_fetch).mean()) if nvme.any() else None,
    )


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float
    num_requests: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    computed_replicas: float
    new_version_share: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def time_series(result: SimResult, window_s: float) -> list[Window]:
    """Per window of arrival time: hit rate, TTFT p50/p99, prefill run (replica-equivalents)."""
    wl, prof = result.config.workload, result.config.profile
    bins = (result.arrival_s // window_s).astype(np.int64)
    windows = []
    for b in range(int(result.config.duration_s // window_s)):
        sel = bins == b
        count = int(sel.sum())
        if count == 0:
            continue
        hits = result.tier[sel] != TIER_MISS
        computed = count * wl.suffix_tokens + int((~hits).sum()) * wl.prefix_tokens
        ttft = result.ttft_s[sel]
        windows.append(
            Window(
                start_s=b * window_s,
                num_requests=count,
                hit_rate=float(hits.mean()),
                ttft_p50_s=float(np.percentile(ttft, 50)),
                ttft_p99_s=float(np.percentile(ttft, 99)),
                computed_replicas=computed / window_s * prof.recompute_s_per_token,
                new_version_share=float(result.new_version[sel].mean()),
            )
        )
    return windows
