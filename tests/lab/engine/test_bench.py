"""`kvfleet bench replica` runs end to end on a tiny model. Timings are not asserted (no timed
tests); what follows from them is: each printed ratio is the quotient of the printed figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_lab.cli import kvfleet_app

app = kvfleet_app()


def test_bench_replica_json_on_a_tiny_model(tiny_dir: Path) -> None:
    result = CliRunner().invoke(app, [
        "bench", "replica", "--model-dir", str(tiny_dir), "--prefill-tokens", "32,48",
        "--prompt-tokens", "64", "--reps", "1", "--concurrency", "1,2", "--decode-tokens", "3",
        "--device", "cpu", "--cpu-threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["cpu_threads"] == 1 and r["attn_impl"] == "sdpa" and r["reps"] == 1
    # --prompt-tokens joins the prefill lengths; its figures are the top-level ones
    assert [p["tokens"] for p in r["prefill"]] == [32, 48, 64]
    main = r["prefill"][2]
    assert r["ttft_full_prefill_s"] == main["ttft_full_prefill_s"]
    assert r["transformers_prefill_s"] == main["transformers_prefill_s"]
    for p in r["prefill"]:
        assert p["ratio"] == pytest.approx(p["ttft_full_prefill_s"] / p["transformers_prefill_s"])
    # 64 prompt tokens: the last one is always computed, so 3 whole blocks (48 tokens) hit.
    assert r["cached_tokens_t0"] == r["cached_tokens_t1"] == 48
    assert r["t0_vs_suffix"] == pytest.approx(r["ttft_t0_hit_s"] / r["suffix_prefill_s"])
    assert r["t1_vs_suffix"] == pytest.approx(r["ttft_t1_hit_s"] / r["suffix_prefill_s"])
    assert r["suffix_at_position_s"] > 0
    assert r["t0_vs_suffix_at_position"] == pytest.approx(
        r["ttft_t0_hit_s"] / r["suffix_at_position_s"])
    # the T1 copy moves K and V of the 4 full blocks: 2 x 2 layers x 2 heads x 64 x 16 x 4 B
    assert r["t1_copy_bytes"] == 2 * 2 * 2 * 64 * 16 * 4
    assert r["t1_copy_vs_raw"] == pytest.approx(r["raw_copy_s"] / r["t1_copy_s"])
    assert [d["concurrency"] for d in r["decode"]] == [1, 2]
    for d in r["decode"]:
        assert d["ratio"] == pytest.approx(d["decode_tok_s"] / d["transformers_decode_tok_s"])
        assert min(d["decode_tok_s"], d["decode_cache_tok_s"],
                   d["transformers_decode_tok_s"]) > 0
    assert r["deterministic_concurrency"] == 2
    assert r["fast_tok_s"] == r["decode"][1]["decode_tok_s"]
    assert r["deterministic_ttft_price"] == pytest.approx(
        r["deterministic_ttft_s"] / r["ttft_full_prefill_s"])
    # 2 in-flight requests of ceil((64 + 3) / 16) = 5 blocks, a budget of twice that; each
    # request's 3 cached blocks are held twice today and once when T0 is the engine's KV
    assert (r["inflight_blocks"], r["kv_budget_blocks"], r["inflight_prefix_blocks"]) == (
        10, 20, 6)
    assert (r["cached_blocks_doubled"], r["cached_blocks_shared"]) == (10, 16)
    assert r["miss_overhead_fraction"] == pytest.approx(
        (r["miss_lookup_s"] + r["miss_store_path_s"]) / r["prefill_s"])


def test_bench_replica_table_and_bad_options(tiny_dir: Path) -> None:
    result = CliRunner().invoke(app, [
        "bench", "replica", "--model-dir", str(tiny_dir), "--prefill-tokens", "32",
        "--prompt-tokens", "32", "--reps", "1", "--concurrency", "1", "--decode-tokens", "2",
        "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "1 CPU thread(s)" in result.output and "x transformers' forward" in result.output
    bad = CliRunner().invoke(app, ["bench", "replica", "--concurrency", "0,8"])
    assert bad.exit_code != 0
    assert "--concurrency takes comma-separated integers >= 1, got '0,8'" in bad.output
