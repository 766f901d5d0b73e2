"""`kvfleet bench vllm-connector` at tiny sizes: both connectors are built and answer, hits are
exactly the stored prompt's blocks, and every copy pattern lands the pool's bytes (the bench
checks them bitwise). Figures are not asserted: speed is the benchmark's business."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvfleet_lab.vllm.bench import COPY_LAYOUTS, format_report, run_bench


def test_bench_runs_both_connectors_and_every_copy_pattern() -> None:
    report = run_bench(sizes=[64, 200], lookup_reps=2, copy_blocks=8, copy_layers=2,
                       copy_heads=2, copy_head_dim=16, copy_reps=1, threads=1)
    assert report.vllm_offloading_error is None
    matched = {(r.connector, r.prompt_tokens, r.case): r.matched_tokens for r in report.lookups}
    assert matched == {
        # kvfleet stops a block short of the prompt's last token (vLLM must compute it)
        ("kvfleet", 64, "miss"): 0, ("kvfleet", 64, "hit"): 48,
        ("kvfleet", 200, "miss"): 0, ("kvfleet", 200, "hit"): 192,
        # vLLM's offloading connector offers every full block it holds
        ("vllm-offloading", 64, "miss"): 0, ("vllm-offloading", 64, "hit"): 64,
        ("vllm-offloading", 200, "miss"): 0, ("vllm-offloading", 200, "hit"): 192,
    }
    # 4 of 8 blocks, 2 layers, 2 heads, K and V of 16 dims in float16; every layout, both
    # directions, each checked bitwise by the bench; a contiguous run is one copy for all layers
    copies = [c for c in report.copies if c.pattern != "raw copy"]
    assert {(c.layout, c.pattern) for c in copies} == {
        (layout, f"{d} {p}") for layout in COPY_LAYOUTS for d in ("load", "save")
        for p in ("contiguous", "scattered")}
    assert {c.num_bytes for c in report.copies} == {4 * 16 * 2 * 2 * 2 * 16 * 2}
    assert {c.num_copies for c in copies if c.pattern.endswith("contiguous")} == {1}
    assert {c.num_copies for c in copies if c.pattern.endswith("scattered")} == {4}
    text = format_report(report)
    assert "vllm-offloading" in text and "BHLNC" in text and "raw copy" in text
