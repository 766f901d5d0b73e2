"""vLLM's own BlockPool against the project's model of it (`sim.simulate_vllm`), on the same
requests, where vllm can be found (its environment: docs/cache.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet_lab.cache.blockpool import simulate_vllm_pool, vllm_python
from kvfleet_lab.cache.sim import simulate_vllm
from kvfleet_lab.cache.vllm_pool import read_requests, write_requests
from kvfleet_lab.cache.workloads import generate_workload

PYTHON = vllm_python()


def test_request_file_round_trips(tmp_path: Path) -> None:
    requests = generate_workload("conversation", num_requests=20, seed=2).requests
    write_requests(tmp_path / "r.bin", [r.blocks for r in requests])
    assert read_requests(tmp_path / "r.bin") == [list(r.blocks) for r in requests]


@pytest.mark.skipif(
    PYTHON is None,
    reason="vllm not importable here nor in $KVFLEET_VLLM_PYTHON / $KVFLEET_HOME/vllm-venv "
    "(docs/cache.md: uv venv ~/.cache/kvfleet/vllm-venv; uv pip install vllm==0.33.0)",
)
def test_vllm_block_pool_hits_exactly_what_the_replay_hits() -> None:
    assert PYTHON is not None
    requests = generate_workload("conversation", num_requests=150, seed=1).requests
    capacities = [30, 120, 600]
    pool = simulate_vllm_pool(requests, capacities, python=PYTHON)
    for capacity in capacities:
        ours = simulate_vllm(requests, capacity)
        assert pool[capacity].num_hit_tokens == ours.num_hit_tokens > 0
        assert pool[capacity].num_hit_requests == ours.num_hit_requests
