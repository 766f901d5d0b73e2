"""The operator's benchmarks (`kvfleet bench operator`)."""

__all__: list[str] = []
