"""kvfleet runtime: what runs inside the pods (replica, router, fleet tier) and the `kvfleet` CLI.

The pure core (break-even arithmetic, keys, index, policies, routing, `wire`) never imports torch;
only the modules that touch tensors do. Benchmarks, simulators, the demo and plots live in the
lab, a separate package and distribution that nothing here imports or names: its `kvfleet bench`,
`demo` and `simulate` join the CLI through the `kvfleet.commands` entry points.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
