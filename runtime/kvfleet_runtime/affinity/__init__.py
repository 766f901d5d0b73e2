"""Pure routing core: rendezvous home sets, the routing decision, API-key -> tenant mapping.

No network, no clock reads, no torch: the router server, the operator and the benchmarks all call
these, and several router replicas given the same inputs make the same choice.
"""

from __future__ import annotations

from kvfleet_runtime.affinity.api_keys import ApiKeyMap, bearer_token, load_api_keys, parse_api_keys
from kvfleet_runtime.affinity.decision import (
    LOAD_BOUND,
    MIN_WARM_FRACTION,
    PREFIX_KEY_TOKENS,
    ReplicaLoad,
    RouteDecision,
    RouteReason,
    choose_replica,
    least_loaded,
    owner_rank,
    prefix_key,
)
from kvfleet_runtime.affinity.rendezvous import (
    bounded_home_sets,
    home_sets,
    rendezvous_rank,
    rendezvous_top_k,
    rendezvous_weight,
    weighted_top_k,
)

__all__ = [
    "LOAD_BOUND",
    "MIN_WARM_FRACTION",
    "PREFIX_KEY_TOKENS",
    "ApiKeyMap",
    "ReplicaLoad",
    "RouteDecision",
    "RouteReason",
    "bearer_token",
    "bounded_home_sets",
    "choose_replica",
    "home_sets",
    "least_loaded",
    "load_api_keys",
    "owner_rank",
    "parse_api_keys",
    "prefix_key",
    "rendezvous_rank",
    "rendezvous_top_k",
    "rendezvous_weight",
    "weighted_top_k",
]
