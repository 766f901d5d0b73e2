"""`kvfleet bench replica` runs end to end on a tiny model (figures are not asserted: not timed)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvfleet_runtime.cli import app


def test_bench_replica_json_on_a_tiny_model(tiny_dir: Path) -> None:
    result = CliRunner().invoke(app, [
        "bench", "replica", "--model-dir", str(tiny_dir), "--prompt-tokens", "64", "--reps", "1",
        "--requests", "12", "--concurrency", "2", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["cached_tokens_t0"] == report["cached_tokens_t1"] == 48
    assert report["workload_cached_token_fraction"] > 0
    for name in ("t0_speedup", "t1_speedup", "throughput_ratio", "miss_overhead_fraction"):
        assert report[name] > 0
