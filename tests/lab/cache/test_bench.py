"""`kvfleet bench cache` on tiny sizes: the figures come out and bad input fails cleanly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_lab.cache.bench import (
    bench_hit_rates,
    bench_lookup,
    bench_materialize,
    bench_memo_bytes_per_step,
    bench_metadata,
    bench_request_cpu,
)
from kvfleet_lab.cli import kvfleet_app
from kvfleet_runtime.cache import KVLayout

app = kvfleet_app()


def test_lookup_and_materialize_and_metadata_on_tiny_sizes() -> None:
    (row,) = bench_lookup(num_index_blocks=256, prompt_tokens=(64,), reps=3)
    assert row.num_index_blocks >= 256 and row.p50_us > 0 and row.sha256_p50_us > 0
    assert row.cold_p50_us > 0 and row.cold_p99_us >= row.cold_p50_us
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32")
    m = bench_materialize(layout=layout, prefix_tokens=64, reps=1)
    assert m.num_bytes == 2 * 2 * 4 * 64 * 8 * 4 and m.num_runs == 1
    # Timings are not asserted; each printed ratio is the raw copy over the figure it names.
    assert m.materialize_ratio == pytest.approx(m.raw_copy_s / m.materialize_s)
    assert m.promote_ratio == pytest.approx(m.raw_copy_s / m.promote_s)
    assert m.per_block_ratio == pytest.approx(m.raw_copy_s / m.per_block_s)
    assert m.tp4_ratio == pytest.approx(m.raw_copy_s / 4 / m.tp4_gather_s)
    # Bytes, not time: only what the cache package allocated counts (~170 B a block here; a
    # process-wide count billed other threads' allocations to it: 2,277 B in CI).
    assert 100 < bench_metadata(num_blocks=500, chain_blocks=50) < 400
    # An 80-byte key, a shared 16-byte digest and a dict slot: well under 400 B.
    assert 100 < bench_memo_bytes_per_step(num_steps=2000) < 400


def test_hit_rates_on_a_tiny_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i, "input_length": 600, "output_length": 1, "hash_ids": [i % 3, 100 + i]}
        for i in range(12)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (row,), num_requests, unique = bench_hit_rates(trace, fractions=(0.5,))
    # By hand: 3 roots of 32 blocks + 12 tails of 5 whole blocks (88 tokens); requests 3-11 find
    # their root (512 tokens) in an infinite cache: 9 x 512 of 12 x 600 prompt tokens.
    assert num_requests == 12 and unique == 3 * 32 + 12 * 5
    assert row.capacity_blocks == unique // 2
    assert row.infinite == pytest.approx(9 * 512 / (12 * 600))
    assert row.belady >= max(row.lru, row.kvfleet, row.popularity_oracle)
    assert row.infinite >= row.belady > 0


def test_missing_trace_is_one_clear_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "cache", "--trace", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2
    assert "trace not found" in result.output


def test_request_cpu_serves_hits_and_evicting_misses_on_tiny_sizes() -> None:
    r = bench_request_cpu(num_index_blocks=64, prompt_tokens=160, rounds=2, reps=3)
    # Timings are not asserted: the bench itself checks every hit and miss it times.
    assert r.num_requests == 6 and r.num_index_blocks == 64
    assert r.request_cpu_hit_s > 0 and r.request_cpu_miss_s > 0
    if importlib.util.find_spec("vllm") is None:
        # vLLM's pair is absent with the reason, never zeros or a made-up figure.
        assert r.vllm_request_cpu_hit_s is None and r.vllm_request_cpu_miss_s is None
        assert r.vllm_absent_reason is not None and "vllm does not import" in r.vllm_absent_reason
        assert r.hit_ratio is None and r.miss_ratio is None
    else:
        assert r.vllm_request_cpu_hit_s is not None and r.vllm_request_cpu_hit_s > 0
        assert r.hit_ratio == pytest.approx(r.request_cpu_hit_s / r.vllm_request_cpu_hit_s)
    with pytest.raises(ValueError, match="must hold two prompts"):
        bench_request_cpu(num_index_blocks=10, prompt_tokens=160, rounds=1, reps=1)


def test_request_cpu_section_alone_in_json() -> None:
    result = CliRunner().invoke(app, [
        "bench", "cache", "--only", "request-cpu", "--index-blocks", "512", "--request-reps",
        "2", "--json",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["request_cpu_hit_s"] > 0 and data["request_cpu_miss_s"] > 0
    assert data["lookup"] == [] and data["hit_rates"] == [] and data["materialize"] is None
    if importlib.util.find_spec("vllm") is None:
        assert "vllm_request_cpu_hit_s" not in data and "vllm_request_cpu_miss_s" not in data
        assert "vllm does not import" in data["request_cpu"]["vllm_absent_reason"]


def test_unknown_section_is_one_clear_line() -> None:
    result = CliRunner().invoke(app, ["bench", "cache", "--only", "lookup,nope"])
    assert result.exit_code == 2 and "unknown section(s) nope" in result.output
