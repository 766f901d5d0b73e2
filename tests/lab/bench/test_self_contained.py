"""A copy of the repository, with nothing beside it, runs `kvfleet bench policies` on the vendored
Mooncake trace and prints the figures the in-tree run prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvfleet_lab.cli.benchmarks import default_trace
from kvfleet_lab.traces import DEFAULT_TRACE, TRACE_NAME

ROOT = Path(__file__).resolve().parents[3]

# `kvfleet bench policies --trace-requests 200 --json` on the trace, recorded before the layout
# moved the replays into kvfleet_lab (the trace passed explicitly then): hit tokens per capacity.
# kvfleet's re-recorded for issue 16 (first-sighting admission, the ghost-chosen ranking; then
# the store cap only under a count ranking: 3% 33,280 -> 25,136, 10% 44,416 -> 54,528, i.e. at or
# above vLLM at every capacity where 10% was 0.91x). S3-FIFO and SIEVE, the anchors, recorded when
# they joined the bench (on these 200 requests SIEVE leads; on the whole trace it trails kvfleet
# in every cell, docs/cache.md).
EXPECTED_HIT_TOKENS = {
    0.01: {"no-cache": 0, "vllm": 14336, "radix": 14336, "s3fifo": 14336, "sieve": 28672,
           "kvfleet": 14336, "belady": 72736, "infinite": 164800},
    0.03: {"no-cache": 0, "vllm": 22576, "radix": 14336, "s3fifo": 22576, "sieve": 36912,
           "kvfleet": 25136, "belady": 129632, "infinite": 164800},
    0.1: {"no-cache": 0, "vllm": 48640, "radix": 48640, "s3fifo": 48640, "sieve": 62976,
          "kvfleet": 54528, "belady": 164800, "infinite": 164800},
    0.3: {"no-cache": 0, "vllm": 84928, "radix": 84928, "s3fifo": 84928, "sieve": 99264,
          "kvfleet": 84928, "belady": 164800, "infinite": 164800},
}


def test_the_cli_names_the_vendored_trace() -> None:
    assert default_trace() == DEFAULT_TRACE and DEFAULT_TRACE.is_file()
    assert DEFAULT_TRACE.is_relative_to(ROOT / "runtime" / "kvfleet_lab" / "traces")
    notice = (DEFAULT_TRACE.parent / "README.md").read_text()
    assert "kvcache-ai/Mooncake" in notice
    assert "FAST25-release/traces/synthetic_trace.jsonl" in notice
    assert "Apache License" in (DEFAULT_TRACE.parent / "LICENSE").read_text()


def test_bench_policies_runs_from_a_copy_with_nothing_beside_it(tmp_path: Path) -> None:
    copy = tmp_path / "alone" / "kvfleet"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", ".ruff_cache")
    for part in ("runtime", "operator"):
        shutil.copytree(ROOT / part, copy / part, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    assert not (copy.parent / "shared").exists() and not (copy.parent.parent / "shared").exists()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join([str(copy / "runtime"), str(copy / "operator")]),
        "MPLBACKEND": "Agg",
        "COLUMNS": "200",
    }
    code = "import kvfleet_lab, kvfleet_runtime; print(kvfleet_lab.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(copy), where  # the copy runs, not this checkout
    result = subprocess.run(
        [sys.executable, "-m", "kvfleet_lab.cli", "bench", "policies", "--trace-requests",
         "200", "--workloads", "trace", "--json", "--out", str(tmp_path / "out")],
        cwd=copy, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (trace,) = json.loads(result.stdout)["workloads"]
    assert trace["description"] == f"Mooncake synthetic trace ({TRACE_NAME}), first 200 requests"
    assert (trace["num_requests"], trace["num_tokens"], trace["num_unique_blocks"]) == (
        200, 2_663_480, 156_083)
    got = {
        row["capacity_fraction"]: {name: f["num_hit_tokens"] for name, f in row["figures"].items()}
        for row in trace["rows"]
    }
    assert got == EXPECTED_HIT_TOKENS
