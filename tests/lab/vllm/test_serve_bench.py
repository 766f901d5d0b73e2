"""`kvfleet bench vllm-serve`'s pure parts: the trace as prompts, vLLM's counters and the bench
client's result read back, the targets' ratios. No vLLM, no server."""

from __future__ import annotations

import json

import pytest

from kvfleet_lab.traces import DEFAULT_TRACE
from kvfleet_lab.vllm.serve_bench import (
    RunFigures,
    SourceTokens,
    busiest_roots,
    by_source,
    read_run,
    saved_ratio,
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
