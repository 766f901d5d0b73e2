"""`kvfleet bench operator`: the planners' benchmark, reachable from the kvfleet CLI."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvfleet_lab.cli import kvfleet_app

app = kvfleet_app()


def test_bench_operator_quick_json() -> None:
    result = CliRunner().invoke(app, ["bench", "operator", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    # The design's reference case (70B, GQA-8, FP16 KV, H100, TP4): 9.26 GB/s.
    assert report["break_even_GBps"] == 9.264
    homes = report["home-sets (2000 tenants, 44 replicas, k=3)"]
    low, median, high = homes["tenants_per_replica_min_median_max"]
    # 2,000 tenants x 3 homes over 44 replicas: 136.4 on average.
    assert low <= median <= high and low < 2000 * 3 / 44 < high
    assert homes["repeats"] == 5
    assert report["tier decision (one policy)"]["repeats"] == 50
    # The replica list, no home sets: ~140 bytes per replica, none per tenant (48,000+ with them).
    assert 44 * 50 < report["fleet-config publish plan (same fleet)"]["fleet_yaml_bytes"] < 44 * 200


def test_lines_are_for_people_not_python_reprs() -> None:
    result = CliRunner().invoke(app, ["bench", "operator", "--quick"])
    assert result.exit_code == 0, result.output
    assert "{" not in result.output and "'" not in result.output, result.output
    assert "median ms " in result.output
