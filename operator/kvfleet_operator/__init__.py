"""kvfleet operator: reconciles KVCachePolicy and ModelRollout resources (kopf).

It depends on kvfleet_runtime's pure core only, never on torch.
"""

__all__: list[str] = []
