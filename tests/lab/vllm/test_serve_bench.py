"""`kvfleet bench vllm-serve`'s pure parts: the trace as prompts, vLLM's counters and the bench
client's result read back, the targets' ratios; the runner's options, its report written as it
goes and its stop on a signal. No vLLM, no server."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvfleet_lab.traces import DEFAULT_TRACE
from kvfleet_lab.vllm import serve_run
from kvfleet_lab.vllm.serve_bench import (
    FLEET_FRONTS,
    FRONT_SEEDS,
    FRONTS,
    RunFigures,
    SourceTokens,
    busiest_roots,
    by_source,
    read_run,
    saved_ratio,
    select_fronts,
    summary,
    trace_rows,
)

ROWS = [
    {"hash_ids": [7, 1, 2], "output_length": 3},
    {"hash_ids": [9, 5], "output_length": 100},
    {"hash_ids": [7, 1, 3], "output_length": 0},
    {"hash_ids": [8], "output_length": 2},
    {"hash_ids": [9, 6], "output_length": 4},
    {"hash_ids": [], "output_length": 4},
]


def test_busiest_roots_rank_by_count_then_smaller_id() -> None:
    assert busiest_roots(ROWS, 1) == {7}
    assert busiest_roots(ROWS, 2) == {7, 9}
    assert busiest_roots(ROWS, 9) == {7, 8, 9}


def test_trace_rows_keep_the_busiest_roots_in_order_and_cap_lengths() -> None:
    out = trace_rows(ROWS, num_requests=10, num_roots=1, block_tokens=2, max_blocks=2,
                     max_output_tokens=8)
    assert out == [
        {"timestamp": 0, "input_length": 4, "output_length": 3, "hash_ids": [7, 1]},
        {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [7, 1]},
    ]  # at least one output token
    both = trace_rows(ROWS, num_requests=3, num_roots=2, block_tokens=128, max_blocks=3,
                      max_output_tokens=8, id_offset=100)
    assert [r["hash_ids"] for r in both] == [[107, 101, 102], [109, 105], [107, 101, 103]]
    assert [r["input_length"] for r in both] == [384, 256, 384]
    assert both[1]["output_length"] == 8


def test_the_vendored_trace_gives_rows_that_reuse_most_of_their_blocks() -> None:
    rows = [json.loads(line) for line in DEFAULT_TRACE.read_text().splitlines() if line]
    out = trace_rows(rows, num_requests=96, num_roots=16, block_tokens=128, max_blocks=12,
                     max_output_tokens=8)
    assert len(out) == 96
    seen: set[tuple[int, ...]] = set()
    reused = total = 0
    for r in out:
        chain = [tuple(r["hash_ids"][: i + 1]) for i in range(len(r["hash_ids"]))]
        reused += next((i for i, c in enumerate(chain) if c not in seen), len(chain))
        total += len(chain)
        seen.update(chain)
    assert reused / total > 0.8


@pytest.mark.parametrize("bad", [{"num_requests": 0}, {"num_roots": 0}, {"block_tokens": 0},
                                 {"max_blocks": 0}])
def test_trace_rows_refuse_empty_sizes(bad: dict[str, int]) -> None:
    kwargs = {"num_requests": 1, "num_roots": 1, "block_tokens": 1, "max_blocks": 1, **bad}
    with pytest.raises(ValueError, match=f"{next(iter(bad))}=0"):
        trace_rows(ROWS, max_output_tokens=1, **kwargs)


METRICS = """# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 601.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 512.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="tiny",source="local_cache_hit"} 128.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 256
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1497.0
"""


def test_by_source_sums_engines_per_source_and_ignores_other_series() -> None:
    assert by_source(METRICS) == SourceTokens(601.0, 640.0, 256.0)
    assert by_source(METRICS).saved == 896.0 and by_source(METRICS).total == 1497.0
    assert by_source("") == SourceTokens()


def test_by_source_refuses_a_source_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="'disk'"):
        by_source('vllm:prompt_tokens_by_source_total{source="disk"} 1\n')


def test_source_tokens_subtract_for_a_run() -> None:
    assert SourceTokens(10, 20, 30) - SourceTokens(1, 2, 3) == SourceTokens(9, 18, 27)


RESULT = {"completed": 40, "failed": 0, "request_throughput": 3.5, "median_ttft_ms": 50.0,
          "p99_ttft_ms": 300.0}


def test_read_run_takes_the_clients_figures() -> None:
    r = read_run("kvfleet", "mooncake", RESULT, SourceTokens(100, 50, 50))
    assert (r.num_requests, r.request_throughput, r.ttft_p50_ms, r.ttft_p99_ms) == (
        40, 3.5, 50.0, 300.0)
    d = r.to_dict()
    assert d["tokens"]["saved"] == 100 and d["hit_fraction"] == 0.5


@pytest.mark.parametrize(("key", "value"), [("completed", 0), ("median_ttft_ms", None),
                                            ("p99_ttft_ms", True)])
def test_read_run_refuses_a_run_without_figures(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key if key == "completed" else repr(key)):
        read_run("x", "w", {**RESULT, key: value}, SourceTokens())


def _run(config: str, saved_cache: float, saved_ext: float, ttft: float) -> RunFigures:
    return RunFigures(config, "w", 10, 0, 1.0, ttft, 2 * ttft,
                      SourceTokens(100, saved_cache, saved_ext))


def test_summary_gives_the_targets_ratios() -> None:
    runs = [_run("vllm", 10, 0, 90), _run("vllm-offloading", 10, 30, 80),
            _run("kvfleet", 10, 50, 60), _run("fleet-router", 40, 80, 50),
            _run("fleet-round-robin", 20, 60, 55), _run("fleet-round-robin-plain", 20, 0, 70)]
    row = summary(runs)["w"]
    assert row["kvfleet_vs_offloading_hit_tokens"] == 60 / 40
    assert row["kvfleet_vs_offloading_ttft_p50"] == 60 / 80
    assert row["router_vs_round-robin_saved"] == 120 / 80
    assert row["router_vs_round-robin-plain_saved"] == 120 / 20
    assert saved_ratio(runs[0], _run("none", 0, 0, 1)) is None
    assert summary(runs[:1]) == {"w": {}}


def test_select_fronts_keeps_the_order_given_and_defaults_to_every_front() -> None:
    assert select_fronts(None, lmcache=False) == tuple(f for f in FRONTS if f != "lmcache")
    assert select_fronts(None, lmcache=True) == FRONTS
    assert select_fronts("fleet-router, fleet-round-robin,vllm,fleet-router", lmcache=False) == (
        "fleet-router", "fleet-round-robin", "vllm")
    assert set(FLEET_FRONTS) == {"fleet-router", "fleet-round-robin", "fleet-round-robin-plain"}
    assert len(set(FRONT_SEEDS.values())) == len(FRONTS)  # no two fronts share prompts


@pytest.mark.parametrize(("text", "lmcache", "message"), [
    ("fleet-router,fleet-rr", False, r"unknown front\(s\) 'fleet-rr'; known: vllm, "),
    (" , ", False, "no front named"),
    ("lmcache", False, "needs --lmcache-vllm"),
])
def test_select_fronts_refuses_what_it_cannot_run(text: str, lmcache: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        select_fronts(text, lmcache=lmcache)


@pytest.mark.parametrize(("argv", "message"), [
    (["--fronts", "vllm,bogus"], "--fronts: unknown front(s) 'bogus'"),
    (["--fronts", "lmcache"], "--fronts: front 'lmcache' needs --lmcache-vllm"),
    (["--out", "/nonexistent-dir/report.json"], "--out: /nonexistent-dir is not a directory"),
])
def test_the_command_refuses_bad_options_with_a_usage_error(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        serve_run.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _bench(tmp_path: Path, *argv: str) -> serve_run.Bench:
    args = serve_run.parser().parse_args([*argv, "--out", str(tmp_path / "report.json")])
    return serve_run.Bench(args, tmp_path, tmp_path / "model", "vllm")


def test_the_report_is_rewritten_whole_after_each_run(tmp_path: Path) -> None:
    b = _bench(tmp_path)
    b.runs.append(_run("fleet-router", 40, 80, 50))
    b.save()
    first = json.loads((tmp_path / "report.json").read_text())
    assert [r["config"] for r in first["runs"]] == ["fleet-router"]
    assert first["engine_vs_vllm"] == [] and "stopped" not in first
    b.runs.append(_run("fleet-round-robin", 20, 60, 55))
    b.fail("fleet-round-robin-plain/mooncake", RuntimeError("vllm bench serve exited 1"))
    b.stopped = "SIGTERM"
    b.save()
    second = json.loads((tmp_path / "report.json").read_text())
    assert second["summary"]["w"]["router_vs_round-robin_saved"] == 120 / 80
    assert second["errors"] == {"fleet-round-robin-plain/mooncake": "vllm bench serve exited 1"}
    assert second["stopped"] == "SIGTERM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no part left over
    assert "engine_vs_vllm" not in _bench(tmp_path, "--no-engine").report()


def test_sigterm_and_sigint_stop_the_bench_once(tmp_path: Path) -> None:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve_run._stop_on_signals()
        with pytest.raises(serve_run.Stopped, match="SIGTERM") as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at the next bytecode; this never ends
        assert stop.value.signum == signal.SIGTERM
        # the cleanup after a stop is not cut short by a second signal
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        serve_run._stop_on_signals()
        with pytest.raises(serve_run.Stopped, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
