"""Cache measurements: policy replays, baselines, workloads, comparison, micro-benchmarks, plots."""

__all__: list[str] = []
