"""What the simulator takes from the break-even profiles: KV bytes per token, recompute time per
token, and the bandwidth of each cache tier. Nothing here is a constant of the simulator's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_runtime.breakeven import (
    GPUS,
    MODELS,
    KVDtype,
    ModelProfile,
    lookup_profile,
    plan,
)

DRAM_MEDIUM = "dram-pcie5"
NVME_MEDIUM = "nvme-gen4"


@dataclass(frozen=True, slots=True)
class FleetProfile:
    """One replica's model, dtype and hardware, reduced to the numbers the fleet simulation uses."""

    name: str
    model: str
    kv_dtype: str
    gpu: str
    tp_degree: int
    kv_bytes_per_token: int
    recompute_s_per_token: float
    """Full-speed prefill time of one token on the whole replica (all its TP ranks)."""
    dram_bytes_per_s: float
    """T1: host DRAM over PCIe, the cache tier every replica has."""
    nvme_bytes_per_s: float
    """T3: local NVMe, shared by every concurrent fetch of the host."""
    break_even_bytes_per_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        """One replica's prefill throughput at the profile's dense FLOPS (28,272 tok/s for the
        reference 70B on TP4 H100; the design rounds it to 28,000)."""
        return 1.0 / self.recompute_s_per_token


def fleet_profile(
    model: ModelProfile | str = "reference-70b",
    kv_dtype: KVDtype | str = KVDtype.FP16,
    gpu: str = "h100",
    tp_degree: int = 4,
    name: str | None = None,
) -> FleetProfile:
    """Derive the simulator's profile from `kvfleet_runtime.breakeven.plan`."""
    model_profile = lookup_profile("model", MODELS, model) if isinstance(model, str) else model
    dtype = KVDtype.parse(kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
    gpu_profile = lookup_profile("GPU", GPUS, gpu)
    result = plan(
        model_profile,
        dtype,
        gpu_profile,
        tp_degree,
        prefix_tokens=1,
        media=(DRAM_MEDIUM, NVME_MEDIUM),
        with_levers=False,
    )
    return FleetProfile(
        name=name or f"{model_profile.name} {dtype.value} {gpu_profile.name} TP{tp_degree}",
        model=model_profile.name,
        kv_dtype=dtype.value,
        gpu=gpu_profile.name,
        tp_degree=tp_degree,
        kv_bytes_per_token=result.kv_bytes_per_token,
        recompute_s_per_token=result.recompute_s_per_token,
        dram_bytes_per_s=result.tier(DRAM_MEDIUM).medium.bandwidth_bytes_per_s,
        nvme_bytes_per_s=result.tier(NVME_MEDIUM).medium.bandwidth_bytes_per_s,
        break_even_bytes_per_s=result.break_even_bytes_per_s,
    )
