"""Measurement code: benchmarks, simulators, replays, the demo and plots. Nothing in the product
(kvfleet_runtime except its CLI, kvfleet_operator) imports it."""
