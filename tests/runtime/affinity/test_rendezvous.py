"""Rendezvous hashing: pinned vectors, determinism across processes, ~1/n movement, balance."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_runtime.affinity import home_sets, rendezvous_rank, rendezvous_top_k, rendezvous_weight

REPLICAS = [f"replica-{i}" for i in range(5)]
TENANTS = [f"tenant-{i}" for i in range(2000)]


def test_pinned_vectors() -> None:
    # Pin the hash construction: the operator, every router replica and every release must agree.
    assert rendezvous_weight("tenant-a", "replica-0") == 8010098570909619561
    assert rendezvous_top_k("tenant-a", REPLICAS, 3) == ["replica-3", "replica-2", "replica-0"]
    assert rendezvous_top_k("acme", ["r0", "r1", "r2", "r3"], 2) == ["r1", "r0"]


def test_same_answer_in_a_fresh_process_with_another_hash_seed() -> None:
    code = (
        "from kvfleet_runtime.affinity import home_sets;"
        f"print(sorted(home_sets([f't{{i}}' for i in range(50)], {REPLICAS!r}, 3).items()))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    local = sorted(home_sets([f"t{i}" for i in range(50)], REPLICAS, 3).items())
    assert outs.pop().strip() == str(local)


@given(st.text(max_size=20), st.permutations(REPLICAS), st.integers(1, 7))
def test_input_order_does_not_matter_and_top_k_is_rank_prefix(
    tenant: str, replicas: list[str], k: int
) -> None:
    top = rendezvous_top_k(tenant, replicas, k)
    assert top == rendezvous_top_k(tenant, REPLICAS, k)
    assert top == rendezvous_rank(tenant, replicas)[:k]
    assert len(top) == min(k, len(replicas)) and len(set(top)) == len(top)


def test_fields_are_length_prefixed() -> None:
    assert rendezvous_weight("ab", "c") != rendezvous_weight("a", "bc")


@pytest.mark.parametrize(
    ("replicas", "k", "message"),
    [(["a", "a"], 1, "unique"), (["a"], 0, "k must be")],
)
def test_bad_input(replicas: list[str], k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rendezvous_top_k("t", replicas, k)


def test_empty_replica_list_gives_no_homes() -> None:
    assert rendezvous_top_k("t", [], 3) == []
    assert home_sets(["t"], [], 3) == {"t": ()}


@pytest.mark.parametrize("n", [4, 10, 44])
def test_join_moves_about_one_nth_of_first_homes_and_only_onto_the_newcomer(n: int) -> None:
    before_replicas = [f"r{i}" for i in range(n)]
    after_replicas = [*before_replicas, "newcomer"]
    before = home_sets(TENANTS, before_replicas, 3)
    after = home_sets(TENANTS, after_replicas, 3)
    moved = [t for t in TENANTS if before[t][0] != after[t][0]]
    assert all(after[t][0] == "newcomer" for t in moved)
    expected = len(TENANTS) / (n + 1)
    assert 0.6 * expected < len(moved) < 1.4 * expected
    # A home set changes only by the newcomer entering it (and the last home leaving it).
    for t in TENANTS:
        if before[t] != after[t]:
            assert "newcomer" in after[t]
            assert set(before[t]) - set(after[t]) == {before[t][-1]}


@pytest.mark.parametrize("n", [4, 10, 44])
def test_leave_moves_only_the_tenants_of_the_leaver(n: int) -> None:
    replicas = [f"r{i}" for i in range(n)]
    gone = replicas[n // 2]
    before = home_sets(TENANTS, replicas, 3)
    after = home_sets(TENANTS, [r for r in replicas if r != gone], 3)
    for t in TENANTS:
        if gone not in before[t]:
            assert after[t] == before[t]
        else:
            # The survivors keep their relative order; one new home is appended.
            assert after[t][:2] == tuple(r for r in before[t] if r != gone)
    moved_first = sum(before[t][0] != after[t][0] for t in TENANTS)
    expected = len(TENANTS) / n
    assert 0.6 * expected < moved_first < 1.4 * expected


def test_balance_of_home_sets() -> None:
    replicas = [f"r{i}" for i in range(44)]
    sets = home_sets(TENANTS, replicas, 3)
    load = Counter(r for homes in sets.values() for r in homes)
    mean = 3 * len(TENANTS) / len(replicas)  # ~136 tenants per replica (docs/design.md §1)
    assert set(load) == set(replicas)
    assert max(load.values()) < 1.35 * mean
    assert min(load.values()) > 0.65 * mean
    first = Counter(homes[0] for homes in sets.values())
    assert max(first.values()) < 1.6 * len(TENANTS) / len(replicas)
