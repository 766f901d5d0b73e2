"""The connector's T2 fetch bench (`python -m kvfleet_lab.vllm.t2`) at a tiny size: both paths
fetch the whole run from a real kvfleet peer process (the bench raises otherwise)."""

from __future__ import annotations

import pytest

from kvfleet_lab.vllm.t2 import bench_connector_fetch, main
from kvfleet_runtime.cache import KVLayout


def test_the_bench_fetches_the_run_both_ways() -> None:
    r = bench_connector_fetch(num_tokens=64, reps=1, num_layers=2, num_kv_heads=2, head_dim=16)
    assert r.num_bytes == 4 * KVLayout(2, 2, 16, "float16").bytes_per_block
    assert len(r.connector_s) == len(r.transfer_s) == 1
    assert r.connector_median_s > 0 and r.transfer_median_s > 0
    assert set(r.to_dict()) >= {"connector_median_s", "transfer_median_s", "ratio"}


def test_a_prompt_shorter_than_two_blocks_is_a_usage_error(capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--tokens", "20"])
    assert exc.value.code == 2
    assert "need num_tokens >= 32" in capsys.readouterr().err
