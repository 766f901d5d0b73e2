"""The fleet tier's benchmarks (`kvfleet bench fleet`)."""

__all__: list[str] = []
