"""The demo's report: pure arithmetic over the two runs' request results, and its text form.

Figures (all over successful requests):

- token-weighted hit rate = cached prompt tokens / prompt tokens, per population and overall;
- TTFT p50/p99 of the cache-off baseline and of the cached run (same requests, same processes);
- prefill tokens of each run (prompt tokens the replicas computed) and their difference;
- GPU-seconds saved: the saved tokens priced at the break-even profile of docs/design.md's reference
  case (70B on H100, TP4: 35.4 us per token on 4 GPUs = 141.5 GPU-us per token). The demo's
  model is tiny and runs on CPU; this converts the *tokens* it saved, not its own seconds;
- tier breakdown: each prompt token is T0, T1 or T2 (a hit) or a miss (computed). A replica labels
  a hit with the coldest local tier it read (`X-Kvfleet-Cache-Tier`), so a hit's tokens count
  under that tier; blocks imported from a peer land in its local tiers first, so T2 is inferred:
  the part of a hit longer than any prefix that replica had been sent before can only have come
  from a peer;
- spill rate: share of the router's decisions with `X-Kvfleet-Route: spill`.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence
from typing import Any

from kvfleet_lab.demo._driver import RequestResult
from kvfleet_lab.demo._workload import Workload
from kvfleet_runtime.breakeven import GPUS, MODELS, recompute_s_per_token

__all__ = ["REFERENCE_PROFILE", "build_report", "percentile", "render_report"]

_BLOCK = 16
REFERENCE_MODEL, REFERENCE_GPU, REFERENCE_TP = "reference-70b", "h100", 4
REFERENCE_PROFILE: dict[str, str | int] = {
    "model": REFERENCE_MODEL, "gpu": REFERENCE_GPU, "tp_degree": REFERENCE_TP,
}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _gpu_s_per_token() -> float:
    model, gpu = MODELS[REFERENCE_MODEL], GPUS[REFERENCE_GPU]
    return float(recompute_s_per_token(model, gpu, REFERENCE_TP)) * REFERENCE_TP


def _prefix_hashes(tenant: str, tokens: Sequence[int]) -> list[bytes]:
    """Chained hashes of the prompt's full 16-token blocks (the client's stand-in for the cache's
    own chain: equal hashes = equal tenant and prefix)."""
    h = hashlib.blake2b(tenant.encode(), digest_size=16).digest()
    out = []
    for i in range(len(tokens) // _BLOCK):
        block = array("H", tokens[i * _BLOCK : (i + 1) * _BLOCK]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        out.append(h)
    return out


def _tier_tokens(workload: Workload, results: Sequence[RequestResult]) -> list[dict[str, int]]:
    """Per result: tokens by tier (t0, t1, t2, miss).

    A replica can hold a block locally only if some request it was sent computed it. Concurrent
    requests may reach it in another order than the client sent them, so "sent before" is taken
    generously: every other request to that replica that started before this one ended. Only hit
    tokens beyond all of those prefixes count as T2."""
    by_index = {r.index: r for r in workload.requests}
    chains = [_prefix_hashes(by_index[r.index].tenant, by_index[r.index].token_ids)
              for r in results]
    by_start = sorted(range(len(results)), key=lambda i: results[i].start_s)
    held: dict[str, dict[bytes, int]] = {}
    added = [False] * len(results)
    next_start = 0
    out: list[dict[str, int]] = [{} for _ in results]
    for i in sorted(range(len(results)), key=lambda i: results[i].end_s):
        res = results[i]
        while next_start < len(by_start) and results[by_start[next_start]].start_s < res.end_s:
            j = by_start[next_start]
            counts = held.setdefault(results[j].replica, {})
            for h in chains[j]:
                counts[h] = counts.get(h, 0) + 1
            added[j] = True
            next_start += 1
        counts = held.get(res.replica, {})
        own = 1 if added[i] else 0
        local_blocks = 0
        for h in chains[i]:
            if counts.get(h, 0) - own <= 0:
                break
            local_blocks += 1
        local = min(res.cached_tokens, local_blocks * _BLOCK)
        tier = res.tier if res.tier in ("t0", "t1") else "t1"
        tiers = {"t0": 0, "t1": 0, "t2": 0, "miss": res.prompt_tokens - res.cached_tokens}
        tiers[tier] += local
        tiers["t2"] += res.cached_tokens - local
        out[i] = tiers
    return out


def _run_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft_ms = [r.ttft_s * 1e3 for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    routes: dict[str, int] = {}
    for r in ok:
        routes[r.route or "unknown"] = routes.get(r.route or "unknown", 0) + 1
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"HTTP {r.status}" if r.status else (r.error.split(":")[0] or "error")
            errors[key] = errors.get(key, 0) + 1
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": errors,
        "wall_s": max((r.end_s for r in results), default=0.0),
        "ttft_ms": {
            "p50": percentile(ttft_ms, 50),
            "p99": percentile(ttft_ms, 99),
            "mean": sum(ttft_ms) / len(ttft_ms) if ttft_ms else math.nan,
        },
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "routes": routes,
        "spill_rate": routes.get("spill", 0) / len(ok) if ok else 0.0,
    }


def build_report(
    workload: Workload,
    baseline: Sequence[RequestResult],
    cached: Sequence[RequestResult],
    *,
    fleet: dict[str, Any],
    timings_s: dict[str, float],
    command: str,
) -> dict[str, Any]:
    base, run = _run_summary(baseline), _run_summary(cached)
    populations = sorted({r.population for r in workload.requests})
    ok_cached = [r for r in cached if r.ok]
    tiers = _tier_tokens(workload, ok_cached)
    base_by_pop = {p: [r for r in baseline if r.ok and r.population == p] for p in populations}
    by_pop: dict[str, Any] = {}
    for pop in populations:
        rows = [r for r in ok_cached if r.population == pop]
        prompt = sum(r.prompt_tokens for r in rows)
        hit = sum(r.cached_tokens for r in rows)
        by_pop[pop] = {
            "num_requests": len(rows),
            "prompt_tokens": prompt,
            "cached_tokens": hit,
            "token_hit_rate": hit / prompt if prompt else 0.0,
            "ttft_ms_p50": percentile([r.ttft_s * 1e3 for r in rows], 50),
            "baseline_ttft_ms_p50": percentile([r.ttft_s * 1e3 for r in base_by_pop[pop]], 50),
        }
    tier_totals = {"t0": 0, "t1": 0, "t2": 0, "miss": 0}
    tier_by_pop = {p: dict.fromkeys(tier_totals, 0) for p in populations}
    for res, counts in zip(ok_cached, tiers, strict=True):
        for tier, n in counts.items():
            tier_totals[tier] += n
            tier_by_pop[res.population][tier] += n
    total_tokens = sum(tier_totals.values())
    saved = base["prefill_tokens"] - run["prefill_tokens"]
    gpu_s_per_token = _gpu_s_per_token()
    return {
        "command": command,
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "num_requests": len(workload.requests),
            "num_tenants": len(workload.tenants),
            "prompt_tokens": workload.num_prompt_tokens,
            "populations": {
                p: sum(1 for r in workload.requests if r.population == p) for p in populations
            },
        },
        "fleet": fleet,
        "timings_s": timings_s,
        "runs": {"baseline": base, "cached": run},
        "hit_rate": {"token_weighted": run["token_hit_rate"], "by_population": by_pop},
        "ttft_ms": {
            "baseline": base["ttft_ms"],
            "cached": run["ttft_ms"],
            "speedup_p50": base["ttft_ms"]["p50"] / run["ttft_ms"]["p50"]
            if run["ttft_ms"]["p50"] > 0 else math.nan,
            "speedup_p99": base["ttft_ms"]["p99"] / run["ttft_ms"]["p99"]
            if run["ttft_ms"]["p99"] > 0 else math.nan,
        },
        "prefill": {
            "baseline_tokens": base["prefill_tokens"],
            "cached_tokens": run["prefill_tokens"],
            "tokens_saved": saved,
            "saved_fraction": saved / base["prefill_tokens"] if base["prefill_tokens"] else 0.0,
        },
        "gpu_seconds_saved": {
            "value": saved * gpu_s_per_token,
            "gpu_s_per_token": gpu_s_per_token,
            "profile": dict(REFERENCE_PROFILE),
            "note": "prefill tokens saved x the reference case's recompute cost (70B on H100, "
            "TP4: 35.4 us/token x 4 GPUs); the demo's own model is tiny and runs on CPU",
        },
        "tiers": {
            "tokens": tier_totals,
            "share": {t: n / total_tokens if total_tokens else 0.0 for t, n in tier_totals.items()},
            "by_population": tier_by_pop,
            "note": "T2 is inferred: hit tokens beyond any prefix the replica had been sent",
        },
        "routing": {"spill_rate": run["spill_rate"], "decisions": run["routes"]},
        "timeline": [
            {"end_s": r.end_s, "population": r.population, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "ttft_ms": r.ttft_s * 1e3, "replica": r.replica}
            for r in sorted(ok_cached, key=lambda r: r.end_s)
        ],
        "baseline_ttft_ms": [r.ttft_s * 1e3 for r in baseline if r.ok],
    }


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.0f} ms"


def render_report(report: dict[str, Any]) -> list[str]:
    """The report as plain lines (the CLI prints them; no markup)."""
    wl, ttft, pre = report["workload"], report["ttft_ms"], report["prefill"]
    runs, fleet = report["runs"], report["fleet"]
    lines = [
        f"workload   {wl['description']}; {wl['prompt_tokens']:,} prompt tokens",
        f"fleet      router + {fleet['num_replicas']} replicas ({fleet['model_preset']} model, "
        f"CPU), hint index: {fleet['hint_index']}",
        "",
        "token-weighted hit rate (cached run)",
    ]
    for pop, row in report["hit_rate"]["by_population"].items():
        lines.append(
            f"  {pop:<14} {row['token_hit_rate']:6.1%}   {row['cached_tokens']:>8,} of "
            f"{row['prompt_tokens']:>8,} tokens, {row['num_requests']} requests; TTFT p50 "
            f"{_ms(row['ttft_ms_p50'])} (no cache {_ms(row['baseline_ttft_ms_p50'])})"
        )
    lines += [
        f"  {'all':<14} {report['hit_rate']['token_weighted']:6.1%}",
        "",
        f"TTFT       no cache  p50 {_ms(ttft['baseline']['p50'])}  p99 "
        f"{_ms(ttft['baseline']['p99'])}",
        f"           cache     p50 {_ms(ttft['cached']['p50'])}  p99 "
        f"{_ms(ttft['cached']['p99'])}   ({ttft['speedup_p50']:.1f}x / "
        f"{ttft['speedup_p99']:.1f}x faster)",
        f"prefill    {pre['baseline_tokens']:,} tokens without the cache, "
        f"{pre['cached_tokens']:,} with it: {pre['tokens_saved']:,} saved "
        f"({pre['saved_fraction']:.1%})",
        f"GPU-s      {report['gpu_seconds_saved']['value']:.2f} GPU-seconds saved at the "
        "reference case's cost (70B, H100 TP4: 141.5 GPU-us per prefill token)",
    ]
    share = report["tiers"]["share"]
    lines.append(
        "tiers      " + "  ".join(f"{t.upper() if t != 'miss' else 'miss'} {share[t]:.1%}"
                                  for t in ("t0", "t1", "t2", "miss"))
        + "   (share of prompt tokens)"
    )
    t2 = fleet.get("t2_measured")
    if t2:
        others = {o: n for o, n in t2["outcomes"].items()
                  if o != "ok" and not o.startswith("partial_")}
        why = ""
        if not t2["fetches_ok"] and set(others) == {"no_peer"}:
            why = (f"; the peers were asked on {others['no_peer']} local misses and held none "
                   f"of them (a miss at a request's home was a miss fleet-wide)")
        elif others:
            why = "; no fetch: " + ", ".join(f"{o} {n}" for o, n in sorted(others.items()))
        lines.append(
            f"T2         {t2['fetches_ok']} peer fetches, {t2['tokens_fetched']:,} tokens "
            f"({t2['bytes_fetched'] / 2**20:,.1f} MiB) measured on the replicas" + why
        )
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(report["routing"]["decisions"].items()))
    lines.append(f"routing    spill rate {report['routing']['spill_rate']:.1%} ({decisions})")
    errs = {**runs["baseline"]["errors"], **runs["cached"]["errors"]}
    if errs:
        lines.append("errors     " + ", ".join(f"{e} {n}" for e, n in sorted(errs.items())))
    lines.append(
        f"wall time  no cache {runs['baseline']['wall_s']:.0f} s, cache "
        f"{runs['cached']['wall_s']:.0f} s; total {report['timings_s']['total']:.0f} s"
    )
    return lines
