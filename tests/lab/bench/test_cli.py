"""`kvfleet bench` as a user runs it: the policy comparison's table, JSON, plots; the bench
group's default and `all`; the other benchmarks still reachable."""

from __future__ import annotations

import functools
import gzip
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_lab.cache.sim import load_mooncake_trace
from kvfleet_lab.cli import kvfleet_app
from kvfleet_lab.traces import TRACES
from tests.lab.cache.test_sim import write_trace

app = kvfleet_app()

TINY = ["--requests", "60", "--fractions", "0.1,0.5"]


def kvfleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfleet_lab.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={"COLUMNS": "220", "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"},
    )


ROWS = [(0, 1100, [1, 2, 3]), (1000, 600, [1, 4]), (2000, 1100, [1, 2, 3]), (3000, 70, [9])]


def test_policies_writes_its_table_json_and_plots(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", ROWS)
    out = tmp_path / "out"
    result = kvfleet(
        "policies",
        "--trace",
        str(trace),
        "--workloads",
        "trace,agent-loops",
        *TINY,
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    for text in (
        "vLLM", "radix", "S3-FIFO", "SIEVE", "kvfleet", "Belady", "inf.", "kv/vLLM", "kv/SIEVE",
        "agent-loops",
    ):
        assert text in result.stdout, text
    table = (out / "policies.md").read_text()
    assert "| capacity | vLLM | radix | S3-FIFO | SIEVE | kvfleet | Belady | infinite |" in table
    assert "### trace" in table and "### agent-loops" in table
    report = json.loads((out / "policies.json").read_text())
    trace_result, agent = report["workloads"]
    assert trace_result["num_requests"] == 4 and agent["num_requests"] == 60
    row = trace_result["rows"][1]
    # The trace by hand: 2,192 prompt tokens over 4 requests; at 50% capacity everything the
    # infinite cache hits is hit by the baselines too (request 2 reuses hash id 1's 32 blocks,
    # request 3 all 68 blocks of request 1).
    assert row["figures"]["infinite"]["num_hit_tokens"] == (32 + 68) * 16
    for anchor in ("s3fifo", "sieve"):
        assert 0 < row["figures"][anchor]["num_hit_tokens"] <= (32 + 68) * 16
    assert row["figures"]["no-cache"]["token_hit_rate"] == 0.0
    assert set(row["kvfleet_vs"]) == {"vllm", "radix", "s3fifo", "sieve", "belady"}
    # beside the token hit rate: the prefill compute saved, and kvfleet / Belady per workload
    assert "saved: kv" in result.stdout
    assert "kvfleet / Belady (compute) |" in table and "kvfleet / Belady, trace: 10%" in table
    assert set(row["kvfleet_saved_vs"]) == {"vllm", "radix", "s3fifo", "sieve", "belady"}
    infinite = row["figures"]["infinite"]
    # the hits are the prompts' heads, their cheapest positions: a smaller share of the FLOPs
    assert 0.0 < infinite["compute_saved"] < infinite["token_hit_rate"]
    for name in ("policies.png", "ratios.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = kvfleet("policies", "--workloads", "chat", "--out", str(tmp_path))
    assert result.returncode == 2 and result.stderr.startswith("error: --workloads")
    result = kvfleet("policies", "--fractions", "0,2", "--out", str(tmp_path))
    assert result.returncode == 2 and "--fractions" in result.stderr
    result = kvfleet("policies", "--trace", str(tmp_path / "none.jsonl"), "--out", str(tmp_path))
    assert result.returncode == 2 and "not found" in result.stderr


def test_policies_replays_each_trace_it_is_given_as_its_own_row_set(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = kvfleet(
        "policies", "--trace", "synthetic", "--trace", "conversation", "--trace-requests", "30",
        "--workloads", "trace", "--fractions", "0.1", "--no-vllm-pool", "--json", "--out", str(out),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    synthetic, conversation = json.loads(result.stdout)["workloads"]
    assert (synthetic["name"], conversation["name"]) == ("trace:synthetic", "trace:conversation")
    assert synthetic["description"] == (
        "Mooncake synthetic trace (mooncake_synthetic_trace.jsonl), first 30 requests"
    )
    assert conversation["description"] == (
        "Mooncake conversation trace (mooncake_conversation_trace.jsonl.gz), first 30 requests"
    )
    # The first 30 conversation requests, from the vendored file (tests/lab/cache/test_traces.py).
    assert conversation["num_requests"] == 30 and conversation["num_tokens"] == sum(
        r.num_tokens for r in load_mooncake_trace(TRACES["conversation"].path, max_requests=30)
    )
    (row,) = conversation["rows"]
    figures = row["figures"]
    assert 0 < figures["belady"]["num_hit_tokens"] <= figures["infinite"]["num_hit_tokens"]
    assert "### trace:conversation" in (out / "policies.md").read_text()


@pytest.mark.parametrize(
    ("traces", "expected"),
    [
        (["chat"], "error: --trace: trace not found: 'chat' is neither a vendored trace "
         "(synthetic, conversation) nor a file"),
        (["conversation", "conversation"], "error: --trace: each trace once"),
        (["BROKEN"], "broken.jsonl.gz: not a readable Mooncake trace"),
    ],
)
def test_a_bad_trace_is_one_line_and_exit_2(
    traces: list[str], expected: str, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.jsonl.gz"
    row = b'{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n'
    broken.write_bytes(gzip.compress(row)[:-8])  # cut short: the gzip trailer is missing
    args = [a for t in traces for a in ("--trace", str(broken) if t == "BROKEN" else t)]
    result = CliRunner().invoke(
        app, ["bench", "policies", *args, "--workloads", "trace", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert expected in line and "Traceback" not in result.output


def _replace_policies(monkeypatch: pytest.MonkeyPatch, fake: Callable[..., None]) -> None:
    """`kvfleet bench policies` replaced on the group (same options: typer reads the signature
    through `__wrapped__`), so that the group's own commands are tested without the replays."""
    from kvfleet_lab.cli.benchmarks import bench

    info = next(c for c in bench.registered_commands if c.name == "policies")
    monkeypatch.setattr(info, "callback", functools.wraps(info.callback)(fake))


def test_bench_alone_runs_the_policy_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    _replace_policies(monkeypatch, lambda **_: calls.append("policies"))
    result = CliRunner().invoke(app, ["bench"])
    assert result.exit_code == 0, result.output
    assert calls == ["policies"]


def test_other_benchmarks_are_still_there() -> None:
    runner = CliRunner()
    for name in ("replica", "fleet", "policies", "all"):
        result = runner.invoke(app, ["bench", name, "--help"])
        assert result.exit_code == 0, (name, result.output)


def test_all_runs_each_benchmark_and_reports_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvfleet_lab.cli.benchmarks as mod

    ran: list[list[str]] = []

    class Done:
        def __init__(self, rc: int) -> None:
            self.returncode = rc

    def fake_run(args: list[str], timeout: int) -> Done:
        ran.append(args[3:])
        return Done(1 if args[4] == "fleet" else 0)

    _replace_policies(monkeypatch, lambda **kw: ran.append(["policies", str(kw["out"])]))
    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    result = CliRunner().invoke(app, ["bench", "all", "--out", str(tmp_path), "--skip", "cache"])
    assert result.exit_code == 1, result.output  # fleet "failed"
    names = [r[1] if r[0] == "bench" else r[0] for r in ran]
    assert names[0] == "policies" and "fleet" in names and "replica" in names
    assert "cache" not in names
    replica = next(r for r in ran if r[:2] == ["bench", "replica"])
    assert replica[2:] == ["--reps", "2", "--prefill-tokens", "512,2000", "--prompt-tokens", "1000",
                           "--concurrency", "1,8"]
    assert "exit 1" in result.output


def test_policies_explain_writes_what_belady_keeps_that_kvfleet_drops(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", ROWS)
    out = tmp_path / "out"
    result = kvfleet(
        "policies", "--trace", str(trace), "--workloads", "trace", *TINY, "--explain",
        "--out", str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "blocks kvfleet does not" in result.stdout
    assert "What Belady hits and kvfleet does not, trace" in (out / "policies.md").read_text()
    rows = json.loads((out / "policies.json").read_text())["workloads"][0]["rows"]
    assert all(row["lost_hits"]["capacity_blocks"] == row["capacity_blocks"] for row in rows)
