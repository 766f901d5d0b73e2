"""`kvfleet bench router --override-cost` on a real redis-server: both lookups find the chain's
run (the bench refuses to report one that does not), the stages and Redis' own time come back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


def test_override_cost_reports_both_lookups_side_by_side() -> None:
    cli = Path(sys.executable).with_name("kvfleet")
    out = subprocess.run([str(cli), "bench", "router", "--override-cost", "--rounds", "20"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    report = json.loads(out)
    assert report["blocks"] == 125 and report["rounds"] == 20
    assert set(report["stages"]) == {"encode", "hash", "lookup (keys)", "lookup (one argument)",
                                     "total (keys)", "total (one argument)"}
    assert all(s["p50_us"] > 0 for s in report["stages"].values())
    assert set(report["redis_us_per_lookup"]) == {"lookup (keys)", "lookup (one argument)"}
    assert report["ratio_total_p50"] > 0
    # The override's work without the run queue: the router thread's CPU and Redis' own latency.
    cpu = report["router_cpu_us"]
    assert 0 < cpu["p50_us"] <= cpu["p99_us"]
    # A round's CPU time cannot exceed its wall time.
    assert cpu["p50_us"] <= report["stages"]["total (one argument)"]["p99_us"]
    assert set(report["redis_lookup_us"]) >= {"p50", "p99"}
    assert report["work_p99_us"] == round(cpu["p99_us"] + report["redis_lookup_us"]["p99"], 1)


def test_the_bench_refuses_a_lookup_that_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet_lab.fleet import override_cost
    from kvfleet_runtime.fleet.hint_index import RedisHintIndex

    async def nothing(self: RedisHintIndex, hashes: object, *, tenant: str | None = None) -> dict[
            str, int]:
        return {}

    monkeypatch.setattr(RedisHintIndex, "lookup_runs", nothing)
    with pytest.raises(RuntimeError, match="one argument"):
        override_cost.bench_override_cost(rounds=2)
