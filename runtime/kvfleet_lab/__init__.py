"""kvfleet's lab: everything that measures the product and nothing that ships inside a pod.

Rooms (each mirrors the product package it measures):
  traces/     the vendored Mooncake synthetic trace (Apache-2.0) and its provenance
  cache/      policy replays driven by the shipped `CacheManager` (`sim`), the baselines, the
              generated populations (`workloads`), the side-by-side comparison (`compare`), the
              cache core's micro-benchmarks (`bench`) and the policy plots (`plots`)
  engine/     the replica benchmark (TTFT full prefill vs T0/T1 hits, throughput, miss cost)
  model/      the start-up benchmark: a replica's spawn to first served token and peak RSS, next
              to transformers' `from_pretrained` of the same checkpoint
  fleet/      the fleet tier's benchmarks (T2 bandwidth, router overhead, routing replays)
  operator/   the operator's planner and cluster benchmarks
  simulate/   the fleet-scale simulator (44 replicas, 2,000 tenants) and its plots
  demo/       the `kvfleet demo` driver: local fleet, workloads, report, plots
  cli/        the `kvfleet bench ...`, `kvfleet demo` and `kvfleet simulate` commands

Dependencies point one way: the lab imports the product (kvfleet_runtime, kvfleet_operator);
nothing in the product imports or names the lab (tests/test_imports.py checks it). The
`kvfleet bench`, `kvfleet simulate` and `kvfleet demo` commands are the lab's own (`cli/`), thin
shells that import the rooms they run only when they run; the lab's distribution
(lab/pyproject.toml) adds them to `kvfleet` through the `kvfleet.commands` entry points.
"""

__all__: list[str] = []
