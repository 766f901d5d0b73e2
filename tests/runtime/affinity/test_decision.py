"""The routing decision on tiny fleets with exact expectations."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_runtime.affinity import ReplicaLoad, choose_replica, rendezvous_top_k

NAMES = ["r0", "r1", "r2", "r3", "r4"]
TENANT = "t4"
HOMES = rendezvous_top_k(TENANT, NAMES, 3)  # pinned below so a hash change is caught here too


def loads(**occupancy: float) -> list[ReplicaLoad]:
    return [ReplicaLoad(n, occupancy.get(n, 0.1)) for n in NAMES]


def test_homes_are_pinned() -> None:
    assert HOMES == ["r4", "r3", "r1"]


def test_first_home_under_threshold_wins() -> None:
    d = choose_replica(TENANT, loads(), k=3, occupancy_threshold=0.85)
    assert d is not None and (d.replica, d.reason, d.homes) == ("r4", "home", ("r4", "r3", "r1"))


def test_hot_first_home_passes_to_second_home() -> None:
    d = choose_replica(TENANT, loads(r4=0.9), k=3, occupancy_threshold=0.85)
    assert d is not None and (d.replica, d.reason) == ("r3", "home")


def test_all_homes_hot_spills_to_least_loaded() -> None:
    d = choose_replica(
        TENANT, loads(r4=0.9, r1=0.86, r3=0.85, r0=0.5, r2=0.3), k=3, occupancy_threshold=0.85
    )
    assert d is not None and (d.replica, d.reason) == ("r2", "spill")


def test_spill_ties_break_on_queue_then_name() -> None:
    hot = [ReplicaLoad(n, 0.95) for n in ("r4", "r1", "r3")]
    cold = [ReplicaLoad("r2", 0.2, 0.5), ReplicaLoad("r0", 0.2, 0.5)]
    d = choose_replica(TENANT, hot + cold, k=3, occupancy_threshold=0.85)
    assert d is not None and d.replica == "r0"


def test_not_ready_replicas_are_skipped_and_homes_recomputed() -> None:
    ls = [ReplicaLoad(n, 0.1, ready=(n != "r4")) for n in NAMES]
    d = choose_replica(TENANT, ls, k=3, occupancy_threshold=0.85)
    assert d is not None and d.replica == "r3"
    assert d.homes == tuple(rendezvous_top_k(TENANT, ["r0", "r1", "r2", "r3"], 3))


def test_no_ready_replica_is_none() -> None:
    assert (
        choose_replica(TENANT, [ReplicaLoad("r0", 0.1, ready=False)], k=3, occupancy_threshold=0.85)
        is None
    )
    assert choose_replica(TENANT, [], k=3, occupancy_threshold=0.85) is None


def test_published_home_set_is_used_as_given() -> None:
    d = choose_replica(TENANT, loads(), k=2, occupancy_threshold=0.85, home_set=["r2", "r0", "r1"])
    assert d is not None and (d.replica, d.homes) == ("r2", ("r2", "r0"))


def test_a_published_home_that_is_not_ready_is_replaced_by_rendezvous() -> None:
    ls = [ReplicaLoad(n, 0.1, ready=(n != "r2")) for n in NAMES]
    d = choose_replica(TENANT, ls, k=2, occupancy_threshold=0.85, home_set=["r2", "r0"])
    assert d is not None and d.replica == "r0"
    # r0 kept; the gap is filled with the tenant's best ready replica not already a home.
    assert d.homes == ("r0", "r4")


@pytest.mark.parametrize(
    ("matched", "delay_r2", "expected", "reason"),
    [
        # 1,000 tokens x 35 us = 35 ms saved > 20 ms extra queue: go warm.
        ({"r2": 1000}, 0.020, "r2", "warm"),
        # 35 ms saved < 50 ms extra queue: stay home.
        ({"r2": 1000}, 0.050, "r4", "home"),
        # The home itself is as warm: nothing to gain.
        ({"r2": 1000, "r4": 1000}, 0.0, "r4", "home"),
        # Saving counts only tokens beyond what the home already holds: 200 x 35us = 7ms < 10ms.
        ({"r2": 1200, "r4": 1000}, 0.010, "r4", "home"),
    ],
)
def test_cache_aware_override(
    matched: dict[str, int], delay_r2: float, expected: str, reason: str
) -> None:
    ls = [ReplicaLoad(n, 0.1, delay_r2 if n == "r2" else 0.0) for n in NAMES]
    d = choose_replica(
        TENANT,
        ls,
        k=3,
        occupancy_threshold=0.85,
        matched_tokens=matched,
        recompute_s_per_token=35e-6,
    )
    assert d is not None and (d.replica, d.reason) == (expected, reason)
    if reason == "warm":
        assert d.matched_tokens == 1000 and d.saving_s == pytest.approx(0.015)


def test_override_never_picks_a_hot_replica() -> None:
    ls = [ReplicaLoad(n, 0.9 if n == "r2" else 0.1) for n in NAMES]
    d = choose_replica(
        TENANT,
        ls,
        k=3,
        occupancy_threshold=0.85,
        matched_tokens={"r2": 10**6},
        recompute_s_per_token=35e-6,
    )
    assert d is not None and (d.replica, d.reason) == ("r4", "home")


def test_override_off_without_recompute_cost() -> None:
    d = choose_replica(TENANT, loads(), k=3, occupancy_threshold=0.85, matched_tokens={"r2": 4096})
    assert d is not None and d.replica == "r4"


def test_override_tie_goes_to_smaller_name() -> None:
    d = choose_replica(
        TENANT,
        loads(),
        k=3,
        occupancy_threshold=0.85,
        matched_tokens={"r2": 512, "r0": 512},
        recompute_s_per_token=1e-3,
    )
    assert d is not None and d.replica == "r0"


def test_bad_threshold_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"1\.5"):
        choose_replica(TENANT, loads(), k=3, occupancy_threshold=1.5)


@given(
    st.lists(st.floats(0, 1), min_size=5, max_size=5),
    st.lists(st.floats(0, 0.1), min_size=5, max_size=5),
    st.dictionaries(st.sampled_from(NAMES), st.integers(0, 4096), max_size=5),
)
def test_same_inputs_same_choice_in_any_order(
    occ: list[float], delay: list[float], matched: dict[str, int]
) -> None:
    ls = [ReplicaLoad(n, o, d) for n, o, d in zip(NAMES, occ, delay, strict=True)]
    choices = {
        choose_replica(
            TENANT,
            list(perm),
            k=3,
            occupancy_threshold=0.85,
            matched_tokens=matched,
            recompute_s_per_token=35e-6,
        )
        for perm in itertools.islice(itertools.permutations(ls), 0, 120, 7)
    }
    assert len(choices) == 1
    d = choices.pop()
    assert d is not None
    chosen = next(x for x in ls if x.name == d.replica)
    # Never routes to a replica over the threshold while a home is under it.
    if any(x.kv_occupancy < 0.85 for x in ls if x.name in d.homes):
        assert chosen.kv_occupancy < 0.85
