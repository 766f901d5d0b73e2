"""The replica benchmark (`kvfleet bench replica`)."""

__all__: list[str] = []
