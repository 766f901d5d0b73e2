"""PNG plots of a demo report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvfleet_runtime.cache import CacheTuning

__all__ = ["admission_words", "write_plots"]

_COLORS = {"system_prompt": "#4c72b0", "rag": "#dd8452", "conversation": "#55a868",
           "trace": "#8172b3"}
_TIER_COLORS = {"t0": "#2b6a99", "t1": "#5fa2ce", "t2": "#a1d99b", "miss": "#d3d3d3"}


def admission_words(admit_min_sightings: int | None = None) -> str:
    """When a cold cache stores a prefix, in words: the demo's replicas run the shipped default
    (`CacheTuning.admit_min_sightings`, which the replica's settings default to)."""
    n = CacheTuning(num_t0_blocks=1).admit_min_sightings if admit_min_sightings is None else (
        admit_min_sightings)
    return "stored on first sighting" if n == 1 else f"stored from sighting {n}"


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    return [
        _hit_rate(report, out / "hit_rate_over_time.png"),
        _ttft(report, out / "ttft_distribution.png"),
        _tier_mix(report, out / "tier_mix.png"),
    ]


def _hit_rate(report: dict[str, Any], path: Path) -> Path:
    rows = report["timeline"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = max(5, len(rows) // 12)
    for pop in sorted({r["population"] for r in rows}):
        pts = [r for r in rows if r["population"] == pop]
        xs, ys = [], []
        for i in range(len(pts)):
            chunk = pts[max(0, i - window + 1) : i + 1]
            prompt = sum(r["prompt_tokens"] for r in chunk)
            xs.append(pts[i]["end_s"])
            ys.append(100 * sum(r["cached_tokens"] for r in chunk) / prompt if prompt else 0)
        ax.plot(xs, ys, color=_COLORS.get(pop, "grey"), lw=1.6,
                label=f"{pop} (last {window} requests)")
    cum_prompt = cum_cached = 0
    xs, ys = [], []
    for r in rows:
        cum_prompt += r["prompt_tokens"]
        cum_cached += r["cached_tokens"]
        xs.append(r["end_s"])
        ys.append(100 * cum_cached / cum_prompt)
    ax.plot(xs, ys, color="black", lw=2.2, ls="--", label="all, cumulative")
    ax.set_ylim(0, 100)
    ax.set_xlabel("time since the cached run started (s)")
    ax.set_ylabel("token-weighted hit rate (%)")
    ax.set_title(f"Prefix-cache hit rate over time (cold start: {admission_words()})")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ttft(report: dict[str, Any], path: Path) -> Path:
    cached = sorted(r["ttft_ms"] for r in report["timeline"])
    base = sorted(report["baseline_ttft_ms"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for values, label, color in ((base, "no cache", "#c44e52"), (cached, "cache", "#4c72b0")):
        if not values:
            continue
        ys = [100 * (i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", color=color, lw=2, label=label)
    ttft = report["ttft_ms"]
    for key, color in (("baseline", "#c44e52"), ("cached", "#4c72b0")):
        for q, ls in (("p50", ":"), ("p99", "--")):
            ax.axvline(ttft[key][q], color=color, ls=ls, lw=1,
                       label=f"{'no cache' if key == 'baseline' else 'cache'} {q} "
                       f"{ttft[key][q]:,.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("requests (%)")
    ax.set_title("TTFT distribution, same requests with and without the cache")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _tier_mix(report: dict[str, Any], path: Path) -> Path:
    by_pop: dict[str, dict[str, int]] = report["tiers"]["by_population"]
    groups = [*by_pop, "all"]
    data = {**by_pop, "all": report["tiers"]["tokens"]}
    no_t2 = str(report["fleet"]["hint_index"]).startswith("embedded")
    labels = {"t0": "T0 (device)", "t1": "T1 (host DRAM)",
              "t2": "T2 (peer; off: no shared index)" if no_t2 else "T2 (peer, inferred)",
              "miss": "miss (prefilled)"}
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottoms = [0.0] * len(groups)
    for tier in ("t0", "t1", "t2", "miss"):
        shares = []
        for g in groups:
            total = sum(data[g].values())
            shares.append(100 * data[g][tier] / total if total else 0.0)
        bars = ax.bar(groups, shares, bottom=bottoms, color=_TIER_COLORS[tier],
                      label=labels[tier])
        ax.bar_label(bars, labels=[f"{s:.0f}%" if s >= 4 else "" for s in shares],
                     label_type="center", fontsize=8)
        bottoms = [b + s for b, s in zip(bottoms, shares, strict=True)]
    ax.set_ylim(0, 100)
    ax.set_ylabel("prompt tokens (%)")
    ax.set_title("Where prompt tokens came from (cached run)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
