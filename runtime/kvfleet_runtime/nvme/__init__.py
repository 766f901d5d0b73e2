"""T3: the NVMe tier of a replica (issue 18; docs/design.md §1, revision R1).

    store = NvmeStore.open(NvmeConfig(path, capacity_bytes, block_bytes))   # pure, no torch
    tier = NvmeTier(cache, store, mode="on" | "shadow" | "off")             # torch glue
    cache.set_eviction_sink(tier.offer)     # what the host tier evicts and the policy values
    Engine(..., lower_tiers=[tier, ...])    # a `LowerTier`: the engine's prepare asks it, and it
                                            # reads the continuation into the engine's blocks

`_store` is the block store (one preallocated file, a ring of aligned slots, checksums, O_DIRECT
where the filesystem allows); `_tier` connects it to the `PrefixCache`: its own admission, the
background writer, serving (mode "on") and shadow mode ("shadow": write what would be stored,
read back what would be served, discard it, record the achieved bandwidth per concurrency level).
Importing this package does not import torch: `NvmeTier` loads `_tier` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet_runtime.nvme._store import (
    ALIGN_BYTES,
    MODES,
    STORE_FILENAME,
    BandwidthRecorder,
    NvmeConfig,
    NvmeMode,
    NvmeStats,
    NvmeStore,
    aligned_buffer,
    concurrency_bucket,
    mode_for,
)

if TYPE_CHECKING:
    from kvfleet_runtime.nvme._tier import NvmeTier

__all__ = [
    "ALIGN_BYTES",
    "MODES",
    "STORE_FILENAME",
    "BandwidthRecorder",
    "NvmeConfig",
    "NvmeMode",
    "NvmeStats",
    "NvmeStore",
    "NvmeTier",
    "aligned_buffer",
    "concurrency_bucket",
    "mode_for",
]


def __getattr__(name: str) -> Any:
    # Deferred so that the store (and the bench, and the operator-side arithmetic) never pull torch.
    if name != "NvmeTier":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvfleet_runtime.nvme._tier import NvmeTier

    globals()[name] = NvmeTier
    return NvmeTier
