"""`kvfleet simulate` as a user runs it: a real process, its output, files and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def kvfleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet_lab.cli", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"},
    )


def test_coverage_tables_json_and_plots(tmp_path: Path) -> None:
    result = kvfleet("coverage", "--duration-s", "600", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for text in ("4.47 TiB", "10.9%", "136.4", "312 GiB", "affinity", "random"):
        assert text in result.stdout, text
    report = json.loads((tmp_path / "report.json").read_text())
    runs = {run["policy"]: run["metrics"] for run in report["coverage"]["runs"]}
    assert runs["affinity"]["template_hit_rate"] > runs["random"]["template_hit_rate"]
    png = (tmp_path / "coverage.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_json_goes_to_stdout() -> None:
    result = kvfleet("savings", "--duration-s", "600", "--tenants", "200", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["savings"]["figures"]["saved_tokens_per_s"] == pytest.approx(74_700)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bogus"], "unknown scenario 'bogus'; choose one of: coverage, savings, rollout, what-if"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'; choose one of: reference-70b"),
        (["--gpu", "tpu"], "unknown GPU 'tpu'; choose one of: h100"),
        (["--kv-dtype", "int3"], "unknown KV dtype 'int3'; choose one of"),
        (["--tp", "3"], "TP degree 3 does not divide the 8 KV heads"),
        (["--rps", "0"], "--rps must be a positive finite number"),
        (["--duration-s", "10"], "--duration-s must be at least 600 s"),
        (["--replicas", "0"], "--replicas and --tenants must be positive"),
        (["--warm-utilization", "2"], "--warm-utilization must be in (0, 1], got 2.0"),
    ],
)
def test_bad_input_is_one_line_exit_2_no_traceback(args: list[str], message: str) -> None:
    result = kvfleet(*args)
    assert result.returncode == 2, result.stdout
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
