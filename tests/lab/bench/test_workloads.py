"""The generated populations and the side-by-side comparison record."""

from __future__ import annotations

import itertools

import pytest

from kvfleet_lab.cache.compare import POLICIES, compare_workload
from kvfleet_lab.cache.sim import simulate_infinite, unique_blocks
from kvfleet_lab.cache.workloads import WORKLOADS, generate_workload


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_seeded_sorted_and_reusable(name: str) -> None:
    a = generate_workload(name, num_requests=90, seed=3)
    assert a.requests == generate_workload(name, num_requests=90, seed=3).requests
    assert a.requests != generate_workload(name, num_requests=90, seed=4).requests
    assert len(a.requests) == 90
    times = [r.timestamp_s for r in a.requests]
    assert times == sorted(times)
    for r in a.requests:
        assert len(r.blocks) == r.num_tokens // 16
    assert 0.0 < simulate_infinite(a.requests).token_hit_rate < 1.0


def test_agent_loops_resend_their_growing_transcript() -> None:
    requests = generate_workload("agent-loops", num_requests=200, seed=1).requests
    by_prefix = 0
    for i, r in enumerate(requests):
        # Some earlier request is a strict prefix of this one (its session's previous step).
        if any(
            len(p.blocks) < len(r.blocks) and r.blocks[: len(p.blocks)] == p.blocks and p.blocks
            for p in requests[:i]
        ):
            by_prefix += 1
    assert by_prefix > 100


def test_unknown_workload_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        generate_workload("chat", num_requests=10)
    with pytest.raises(ValueError, match="num_requests"):
        generate_workload("rag", num_requests=0)


def test_comparison_rows_and_ratios() -> None:
    requests = generate_workload("system-prompts", num_requests=150, seed=2).requests
    result = compare_workload("sp", "test", requests, [0.05, 0.5])
    assert result.num_unique_blocks == unique_blocks(requests)
    assert [r.capacity_fraction for r in result.rows] == [0.05, 0.5]
    for row in result.rows:
        assert tuple(row.figures) == POLICIES
        assert row.rate("no-cache") == 0.0 and row.prefill_vs_no_cache("no-cache") == 1.0
        for policy in ("vllm", "radix", "s3fifo", "sieve", "kvfleet"):
            assert row.rate(policy) <= row.rate("belady") <= row.rate("infinite")
        if row.rate("vllm"):
            assert row.kvfleet_vs("vllm") == row.rate("kvfleet") / row.rate("vllm")
        assert row.of_infinite("infinite") == 1.0
    with pytest.raises(ValueError, match="fractions"):
        compare_workload("sp", "test", requests, [0.0])


def test_conversation_turns_resend_the_previous_turn_plus_the_answer() -> None:
    requests = generate_workload("conversation", num_requests=300, seed=1).requests
    # Each turn's prompt starts with the whole previous turn of its session (its full blocks),
    # then the answer to it and a new message: a strict prefix, reused within think time.
    extends = 0
    for i, r in enumerate(requests):
        earlier = [p for p in requests[:i] if p.blocks and r.blocks[: len(p.blocks)] == p.blocks]
        if any(len(p.blocks) < len(r.blocks) for p in earlier):
            extends += 1
    assert extends > 150
    gaps = [b.timestamp_s - a.timestamp_s for a, b in itertools.pairwise(requests)]
    assert min(gaps) >= 0.0
    # The infinite cache hits most of a conversation (every turn but the first is mostly reuse).
    assert simulate_infinite(requests).token_hit_rate > 0.5
