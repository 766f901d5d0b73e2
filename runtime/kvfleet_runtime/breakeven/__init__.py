"""The break-even planner: fetch cached KV or recompute it? (docs/design.md §1, revision R1.)

Pure arithmetic over model, dtype, GPU and storage-media profiles; no torch.
"""

from kvfleet_runtime.breakeven.arithmetic import (
    aggregate_flops,
    break_even_bandwidth,
    check_tp_degree,
    fetch_s,
    kv_bytes_per_token,
    prefill_flops,
    recompute_s_per_token,
)
from kvfleet_runtime.breakeven.hf_config import load_hf_config
from kvfleet_runtime.breakeven.plan import (
    DEFAULT_BATCH_SLACK,
    BreakEvenPlan,
    Lever,
    TierVerdict,
    TpPoint,
    Verdict,
    judge_tier,
    plan,
)
from kvfleet_runtime.breakeven.profiles import (
    DEFAULT_MEDIA,
    GB,
    GPUS,
    MEDIA,
    MODELS,
    TFLOPS,
    GpuProfile,
    KVDtype,
    Medium,
    MLAShape,
    ModelProfile,
    lookup_profile,
    medium_for,
)

__all__ = [
    "DEFAULT_BATCH_SLACK",
    "DEFAULT_MEDIA",
    "GB",
    "GPUS",
    "MEDIA",
    "MODELS",
    "TFLOPS",
    "BreakEvenPlan",
    "GpuProfile",
    "KVDtype",
    "Lever",
    "MLAShape",
    "Medium",
    "ModelProfile",
    "TierVerdict",
    "TpPoint",
    "Verdict",
    "aggregate_flops",
    "break_even_bandwidth",
    "check_tp_degree",
    "fetch_s",
    "judge_tier",
    "kv_bytes_per_token",
    "load_hf_config",
    "lookup_profile",
    "medium_for",
    "plan",
    "prefill_flops",
    "recompute_s_per_token",
]
