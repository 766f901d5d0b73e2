"""The report's arithmetic on hand-made results: hit rates, prefill saved, GPU-seconds, tiers."""

from __future__ import annotations

import math

import pytest

from kvfleet_lab.demo import (
    RequestResult,
    WorkloadSpec,
    build_report,
    builtin_workload,
    percentile,
    render_report,
)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert math.isnan(percentile([], 50))


def make_results(cached: list[int], replicas: list[str], tiers: list[str],
                 ttft_s: float) -> list[RequestResult]:
    wl = builtin_workload("conversations", WorkloadSpec(num_requests=3, num_tenants=1))
    return [
        RequestResult(r.index, r.tenant, r.population, len(r.token_ids), float(i),
                      float(i) + 0.5, ttft_s, 200, c, t, rep, "home")
        for i, (r, c, rep, t) in enumerate(zip(wl.requests, cached, replicas, tiers, strict=True))
    ]


def test_report_figures_and_inferred_t2() -> None:
    wl = builtin_workload("conversations", WorkloadSpec(num_requests=3, num_tenants=1))
    assert len({r.session for r in wl.requests}) == 1  # one session of 3 growing turns
    baseline = make_results([0, 0, 0], ["r0", "r0", "r0"], ["none"] * 3, ttft_s=1.0)
    # Turn 2 hits 64 tokens on r0 (which served turn 1): local. Turn 3 lands on r1, which was
    # never sent this session, and still hits 64 tokens: they can only have come over T2.
    cached = make_results([0, 64, 64], ["r0", "r0", "r1"], ["none", "t1", "t0"], ttft_s=0.25)
    report = build_report(wl, baseline, cached, fleet={"num_replicas": 3,
                          "model_preset": "tiny", "hint_index": "redis"},
                          timings_s={"total": 1.0}, command="kvfleet demo")
    prompt = wl.num_prompt_tokens
    assert report["prefill"] == {"baseline_tokens": prompt, "cached_tokens": prompt - 128,
                                 "tokens_saved": 128, "saved_fraction": 128 / prompt}
    assert report["hit_rate"]["token_weighted"] == 128 / prompt
    assert report["gpu_seconds_saved"]["value"] == pytest.approx(128 * 2 * 70e9 / 989.5e12)
    assert report["tiers"]["tokens"] == {"t0": 0, "t1": 64, "t2": 64, "miss": prompt - 128}
    assert report["ttft_ms"]["speedup_p50"] == pytest.approx(4.0)
    assert report["routing"] == {"spill_rate": 0.0, "decisions": {"home": 3}}
    text = "\n".join(render_report(report))
    assert "T2 " in text and "4.0x" in text
    assert "measured on the replicas" not in text  # no counters given: no such line
    report["fleet"]["t2_measured"] = {"fetches_ok": 1, "tokens_fetched": 64,
                                      "bytes_fetched": 3 << 20,
                                      "outcomes": {"no_peer": 2, "ok": 1}}
    lines = [line for line in render_report(report) if "measured on the replicas" in line]
    assert lines == ["T2         1 peer fetches, 64 tokens (3.0 MiB) measured on the replicas; "
                     "no fetch: no_peer 2"]
    report["fleet"]["t2_measured"] = {"fetches_ok": 0, "tokens_fetched": 0, "bytes_fetched": 0,
                                      "outcomes": {"no_peer": 83}}
    lines = [line for line in render_report(report) if "measured on the replicas" in line]
    assert lines == ["T2         0 peer fetches, 0 tokens (0.0 MiB) measured on the replicas; "
                     "the peers were asked on 83 local misses and held none of them (a miss at a "
                     "request's home was a miss fleet-wide)"]
