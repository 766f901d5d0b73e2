"""`kvfleet bench replica` runs end to end on a tiny model. Timings are not asserted (no timed
tests); what follows from them is: each printed ratio is the quotient of the printed figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_runtime.cli import app


def test_bench_replica_json_on_a_tiny_model(tiny_dir: Path) -> None:
    result = CliRunner().invoke(app, [
        "bench", "replica", "--model-dir", str(tiny_dir), "--prompt-tokens", "64", "--reps", "1",
        "--requests", "12", "--concurrency", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    # 64 prompt tokens: the last one is always computed, so 3 whole blocks (48 tokens) hit.
    assert report["cached_tokens_t0"] == report["cached_tokens_t1"] == 48
    assert report["prompt_tokens"] == 64 and report["reps"] == 1
    assert 0 < report["workload_cached_token_fraction"] < 1
    full = report["ttft_full_prefill_s"]
    assert report["t0_speedup"] == pytest.approx(full / report["ttft_t0_hit_s"])
    assert report["t1_speedup"] == pytest.approx(full / report["ttft_t1_hit_s"])
    assert report["throughput_ratio"] == pytest.approx(
        report["throughput_cache_tok_s"] / report["throughput_no_cache_tok_s"])
    assert report["miss_overhead_fraction"] == pytest.approx(
        (report["miss_lookup_s"] + report["miss_store_path_s"]) / report["prefill_s"])
    for name in ("ttft_full_prefill_s", "ttft_t0_hit_s", "ttft_t1_hit_s", "prefill_s"):
        assert 0 < report[name] < 60, name
