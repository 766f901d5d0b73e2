"""The built-in workloads: populations, sizes, sessions, determinism."""

from __future__ import annotations

import itertools

import pytest

from kvfleet_lab.demo import POPULATIONS, WORKLOADS, WorkloadSpec, builtin_workload


def test_mixed_has_the_three_populations_in_equal_shares() -> None:
    wl = builtin_workload("mixed", WorkloadSpec(num_requests=90, num_tenants=3, scale=0.25))
    counts = {p: sum(r.population == p for r in wl.requests) for p in POPULATIONS}
    assert counts == {"system_prompt": 30, "rag": 30, "conversation": 30}
    assert [r.index for r in wl.requests] == list(range(90))
    assert {r.tenant for r in wl.requests} <= set(wl.tenants)


def test_lengths_follow_the_design_ranges_scaled() -> None:
    wl = builtin_workload("mixed", WorkloadSpec(num_requests=120, scale=0.5))
    rag = [len(r.token_ids) for r in wl.requests if r.population == "rag"]
    system = [len(r.token_ids) for r in wl.requests if r.population == "system_prompt"]
    assert min(rag) >= 1000  # documents of 2,000+ design tokens, halved
    assert max(system) <= 1000 + 60  # system prompts up to 2,000, halved, plus a question


def test_sessions_resend_a_growing_transcript() -> None:
    wl = builtin_workload("conversations", WorkloadSpec(num_requests=40, num_tenants=2))
    sessions: dict[str, list[tuple[int, ...]]] = {}
    for r in wl.requests:
        assert r.session is not None
        sessions.setdefault(r.session, []).append(r.token_ids)
    assert any(len(turns) >= 3 for turns in sessions.values())
    for turns in sessions.values():
        for before, after in itertools.pairwise(turns):
            assert len(after) > len(before)
            assert after[: len(before)] == before


def test_same_seed_same_workload_other_seed_other() -> None:
    spec = WorkloadSpec(num_requests=30)
    assert builtin_workload("mixed", spec) == builtin_workload("mixed", spec)
    assert builtin_workload("mixed", spec) != builtin_workload(
        "mixed", WorkloadSpec(num_requests=30, seed=2))


def test_unknown_workload_lists_the_choices() -> None:
    with pytest.raises(ValueError) as info:
        builtin_workload("chat", WorkloadSpec())
    assert "unknown workload 'chat'" in str(info.value)
    for name in WORKLOADS:
        assert name in str(info.value)
