"""Pure routing core: rendezvous home sets, the routing decision, API-key -> tenant mapping.

No I/O, no clocks read, no torch: the router server, the operator and the benchmarks all call these.
"""

from __future__ import annotations

from kvfleet_runtime.routing.rendezvous import (
    home_sets,
    rendezvous_rank,
    rendezvous_top_k,
    rendezvous_weight,
)

__all__ = [
    "home_sets",
    "rendezvous_rank",
    "rendezvous_top_k",
    "rendezvous_weight",
]
