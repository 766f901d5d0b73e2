"""kvfleet runtime: what runs inside the pods (replica, router, fleet tier) and the `kvfleet` CLI.

The pure core (break-even arithmetic, keys, index, policies, routing, `wire`) never imports torch;
only the modules that touch tensors do. Benchmarks, simulators, the demo and plots live in the
separate `kvfleet_lab` package, which nothing here imports (the CLI only when a command runs).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
