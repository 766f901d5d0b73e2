"""The start-up benchmark (`kvfleet bench startup`)."""

__all__: list[str] = []
