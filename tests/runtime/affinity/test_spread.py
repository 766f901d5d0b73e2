"""A tenant's prefixes spread over its homes, and first homes that do not collide (issue 42),
with exact expectations on tiny fleets; the old guarantees (threshold, no death spiral, spill
per tenant, deterministic ties) under the new rule."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvfleet_runtime.affinity import (
    ReplicaLoad,
    bounded_home_sets,
    choose_replica,
    owner_rank,
    prefix_key,
    rendezvous_rank,
    rendezvous_top_k,
)
from kvfleet_runtime.picker import FleetView

PAIR = ["a", "b"]


def prefix(n: int, tenant: str = "acme") -> bytes:
    """The key of a prompt whose 1,024-token prefix is token `n` repeated."""
    key = prefix_key(tenant, [n] * 1024 + [9] * 64)
    assert key is not None
    return key


def pair(occupancy_a: float = 0.1, occupancy_b: float = 0.1, *, inflight_a: int = 0,
         inflight_b: int = 0) -> list[ReplicaLoad]:
    return [ReplicaLoad("a", occupancy_a, num_inflight=inflight_a),
            ReplicaLoad("b", occupancy_b, num_inflight=inflight_b)]


def test_a_tenants_distinct_prefixes_spread_over_its_homes() -> None:
    # issue 42: one tenant, 12 prefixes, two replicas (k=3: both are homes). The old rule sent
    # all twelve to the first home.
    got = [choose_replica("acme", pair(), k=3, occupancy_threshold=0.85, prefix=prefix(n))
           for n in range(12)]
    assert [d.replica for d in got if d is not None] == [
        "a", "b", "a", "a", "b", "a", "b", "b", "b", "a", "a", "a"]
    assert {d.reason for d in got if d is not None} == {"home"}


def test_a_prefix_keeps_its_owner_whatever_else_the_prompt_holds() -> None:
    first = prefix_key("acme", [5] * 256 + [1] * 100)
    assert first == prefix_key("acme", [5] * 256 + [2] * 700)  # the first 256 tokens decide
    assert first != prefix_key("globex", [5] * 256 + [1] * 100)  # per tenant
    # whole blocks only: tokens 33..40 do not count, and under one block there is no prefix
    assert prefix_key("acme", list(range(40))) == prefix_key("acme", [*range(32), 7, 7])
    assert prefix_key("acme", list(range(15))) is None
    assert owner_rank(prefix(3), ["r2", "r0", "r1"]) == owner_rank(prefix(3), ["r0", "r1", "r2"])


def test_the_load_bound_moves_a_busy_owners_next_request_to_the_next_home() -> None:
    owner = owner_rank(prefix(0), PAIR)  # ["a", "b"]
    assert owner == ["a", "b"]
    # 1 + 0 in flight: cap ceil(1.25 x 2 / 2) = 2, the owner has room
    d = choose_replica("acme", pair(inflight_a=1), k=3, occupancy_threshold=0.85,
                       prefix=prefix(0))
    assert d is not None and d.replica == "a"
    # 2 + 0 in flight: cap ceil(1.25 x 3 / 2) = 2, a third on the owner would pass it
    d = choose_replica("acme", pair(inflight_a=2), k=3, occupancy_threshold=0.85,
                       prefix=prefix(0))
    assert d is not None and (d.replica, d.reason) == ("b", "home")
    # 2 + 1 in flight: cap ceil(1.25 x 4 / 2) = 3, back on the owner
    d = choose_replica("acme", pair(inflight_a=2, inflight_b=1), k=3,
                       occupancy_threshold=0.85, prefix=prefix(0))
    assert d is not None and d.replica == "a"


def test_a_shared_root_does_not_pull_every_new_prefix_to_one_replica() -> None:
    # b owns prefix 1; a holds only the 128-token root every conversation starts with
    assert owner_rank(prefix(1), PAIR)[0] == "b"
    kwargs = {"k": 3, "occupancy_threshold": 0.85, "matched_tokens": {"a": 128},
              "recompute_s_per_token": 1e-3, "prefix": prefix(1)}
    d = choose_replica("acme", pair(), prompt_tokens=1536, **kwargs)  # type: ignore[arg-type]
    assert d is not None and (d.replica, d.reason) == ("b", "home")
    # the old rule (no share of the prompt asked): the root's 128 ms won
    d = choose_replica("acme", pair(), **kwargs)  # type: ignore[arg-type]
    assert d is not None and (d.replica, d.reason) == ("a", "warm")


def test_the_override_still_takes_a_replica_holding_most_of_the_prompt() -> None:
    d = choose_replica("acme", pair(), k=3, occupancy_threshold=0.85,
                       matched_tokens={"a": 1024}, recompute_s_per_token=1e-3,
                       prefix=prefix(1), prompt_tokens=1088)
    assert d is not None and (d.replica, d.reason, d.matched_tokens) == ("a", "warm", 1024)


def test_a_hot_owner_passes_its_prefix_to_the_next_home_and_hot_homes_spill() -> None:
    loads = [ReplicaLoad(n, 0.9 if n == "r1" else 0.1) for n in ("r0", "r1", "r2", "r3")]
    homes = ["r1", "r2", "r0"]
    assert owner_rank(prefix(7), homes) == ["r1", "r2", "r0"]
    d = choose_replica("acme", loads, k=3, occupancy_threshold=0.85, home_set=homes,
                       prefix=prefix(7))
    assert d is not None and (d.replica, d.reason) == ("r2", "home")
    # every home hot: this tenant spills (to the least loaded), whatever its prefix
    loads = [ReplicaLoad(n, 0.9 if n in homes else 0.3) for n in ("r0", "r1", "r2", "r3")]
    d = choose_replica("acme", loads, k=3, occupancy_threshold=0.85, home_set=homes,
                       prefix=prefix(7))
    assert d is not None and (d.replica, d.reason) == ("r3", "spill")


def test_no_death_spiral_a_hot_replica_holding_everything_is_not_chosen() -> None:
    d = choose_replica("acme", pair(occupancy_a=0.9), k=3, occupancy_threshold=0.85,
                       matched_tokens={"a": 1088}, recompute_s_per_token=1e-3,
                       prefix=prefix(0), prompt_tokens=1088)
    assert d is not None and (d.replica, d.reason) == ("b", "home")


@given(
    st.lists(st.floats(0, 1), min_size=4, max_size=4),
    st.lists(st.integers(0, 6), min_size=4, max_size=4),
    st.dictionaries(st.sampled_from(["r0", "r1", "r2", "r3"]), st.integers(0, 2048), max_size=4),
    st.integers(0, 50),
)
def test_same_inputs_same_choice_in_any_order_under_the_spread(
    occ: list[float], inflight: list[int], matched: dict[str, int], n: int
) -> None:
    names = ["r0", "r1", "r2", "r3"]
    loads = [ReplicaLoad(name, o, i * 0.01, num_inflight=i)
             for name, o, i in zip(names, occ, inflight, strict=True)]
    choices = {
        choose_replica("acme", list(perm), k=3, occupancy_threshold=0.85, matched_tokens=matched,
                       recompute_s_per_token=1e-3, prefix=prefix(n), prompt_tokens=2048)
        for perm in itertools.permutations(loads)
    }
    assert len(choices) == 1
    d = choices.pop()
    assert d is not None
    chosen = next(x for x in loads if x.name == d.replica)
    if any(x.kv_occupancy < 0.85 for x in loads if x.name in d.homes):
        assert chosen.kv_occupancy < 0.85


def test_two_tenants_first_homes_do_not_collide_on_two_replicas() -> None:
    # issue 42's collision: both bench tenants rank replica a first under rendezvous
    assert rendezvous_top_k("bench-a", PAIR, 1) == rendezvous_top_k("bench-b", PAIR, 1) == ["a"]
    assert bounded_home_sets(["bench-b", "bench-a"], PAIR, 3) == {
        "bench-a": ("a", "b"), "bench-b": ("b", "a")}


@given(st.sets(st.text("abcdefgh", min_size=1, max_size=6), min_size=1, max_size=40),
       st.integers(1, 7), st.integers(1, 4))
def test_no_replica_is_first_home_of_more_than_its_share(
    tenants: set[str], num_replicas: int, k: int
) -> None:
    replicas = [f"r{i}" for i in range(num_replicas)]
    homes = bounded_home_sets(tenants, replicas, k)
    assert set(homes) == tenants
    firsts = [h[0] for h in homes.values()]
    cap = math.ceil(len(tenants) / num_replicas)
    assert max(firsts.count(r) for r in replicas) <= cap
    for tenant, h in homes.items():
        rank = rendezvous_rank(tenant, replicas)
        assert len(h) == min(k, num_replicas) and len(set(h)) == len(h)
        # the first home is the best one with room; the others keep their rendezvous order
        assert list(h[1:]) == [r for r in rank if r != h[0]][: k - 1]


def test_the_view_plans_known_tenants_first_homes_whole(tmp_path: Path) -> None:
    view = FleetView(static_replicas={"a": "http://10.0.0.1:1", "b": "http://10.0.0.2:1"}, k=3)
    assert view.home_set("bench-b") == ("a", "b")  # not known yet: rendezvous
    view.set_tenants(frozenset({"bench-a", "bench-b"}))
    assert (view.home_set("bench-a"), view.home_set("bench-b")) == (("a", "b"), ("b", "a"))
    assert view.home_set("other") == tuple(rendezvous_top_k("other", PAIR, 6))
