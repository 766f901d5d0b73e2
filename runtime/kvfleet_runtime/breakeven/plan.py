"""The break-even plan: which cache tiers are worth building for a model on given hardware.

Two rules decide a tier (revision R1), and they can disagree:
  latency  -- fetch time < recompute time: the tier helps time to first token;
  capacity -- GPU-seconds spent fetching < GPU-seconds spent recomputing: the tier hands
              compute back to the fleet. Fetches are moved by DMA engines, NICs and storage
              controllers, not by the GPU's cores, so a fetch costs ~0 GPU-seconds.
A tier that passes the latency rule is built. One that passes only the capacity rule is built
for the batch fleet only, as long as its fetch stays within `batch_slack` times the recompute
time: beyond that the request holds its KV slots and scheduler place for longer than the compute
it saves is worth (object storage's ~9x is such a case).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from kvfleet_runtime.breakeven.arithmetic import (
    break_even_bandwidth,
    check_tp_degree,
    fetch_s,
    kv_bytes_per_token,
    recompute_s_per_token,
)
from kvfleet_runtime.breakeven.profiles import (
    DEFAULT_MEDIA,
    GpuProfile,
    KVDtype,
    Medium,
    MLAShape,
    ModelProfile,
    medium_for,
)

DEFAULT_TP_SWEEP = (1, 2, 4, 8)
DEFAULT_BATCH_SLACK = 4.0
# DeepSeek-V3's latent: what the MLA lever assumes a model would adopt.
REFERENCE_MLA = MLAShape(kv_lora_rank=512, qk_rope_head_dim=64)


class Verdict(Enum):
    BUILD = "build"
    BATCH_ONLY = "batch only"
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class TierVerdict:
    medium: Medium
    fetch_s: float
    margin: float
    helps_latency: bool
    helps_capacity: bool
    fetch_gpu_s: float
    recompute_gpu_s: float
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class TpPoint:
    tp_degree: int
    recompute_s_per_token: float
    break_even_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class Lever:
    name: str
    description: str
    break_even_bytes_per_s: float
    break_even_ratio: float
    flips: tuple[tuple[str, Verdict, Verdict], ...]


@dataclass(frozen=True, slots=True)
class BreakEvenPlan:
    model: ModelProfile
    kv_dtype: KVDtype
    gpu: GpuProfile
    tp_degree: int
    prefix_tokens: int
    batch_slack: float
    kv_bytes_per_token: int
    prefix_kv_bytes: int
    recompute_s_per_token: float
    recompute_prefix_s: float
    recompute_prefix_gpu_s: float
    break_even_bytes_per_s: float
    tp_sweep: tuple[TpPoint, ...]
    tiers: tuple[TierVerdict, ...]
    levers: tuple[Lever, ...]

    def tier(self, medium_name: str) -> TierVerdict:
        for verdict in self.tiers:
            if verdict.medium.name == medium_name:
                return verdict
        raise KeyError(medium_name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "kv_dtype": self.kv_dtype.value,
            "gpu": self.gpu.name,
            "gpu_dense_flops": self.gpu.dense_flops,
            "tp_degree": self.tp_degree,
            "prefix_tokens": self.prefix_tokens,
            "batch_slack": self.batch_slack,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefix_kv_bytes": self.prefix_kv_bytes,
            "recompute_s_per_token": self.recompute_s_per_token,
            "recompute_prefix_s": self.recompute_prefix_s,
            "recompute_prefix_gpu_s": self.recompute_prefix_gpu_s,
            "break_even_bytes_per_s": self.break_even_bytes_per_s,
            "tp_sweep": [
                {
                    "tp_degree": p.tp_degree,
                    "recompute_s_per_token": p.recompute_s_per_token,
                    "break_even_bytes_per_s": p.break_even_bytes_per_s,
                }
                for p in self.tp_sweep
            ],
            "tiers": [
                {
                    "medium": t.medium.name,
                    "tier": t.medium.tier,
                    "description": t.medium.description,
                    "bandwidth_bytes_per_s": t.medium.bandwidth_bytes_per_s,
                    "fetch_s": t.fetch_s,
                    "margin": t.margin,
                    "helps_latency": t.helps_latency,
                    "helps_capacity": t.helps_capacity,
                    "fetch_gpu_s": t.fetch_gpu_s,
                    "recompute_gpu_s": t.recompute_gpu_s,
                    "verdict": t.verdict.value,
                }
                for t in self.tiers
            ],
            "levers": [
                {
                    "name": lever.name,
                    "description": lever.description,
                    "break_even_bytes_per_s": lever.break_even_bytes_per_s,
                    "break_even_ratio": lever.break_even_ratio,
                    "flips": [
                        {"medium": m, "from": a.value, "to": b.value} for m, a, b in lever.flips
                    ],
                }
                for lever in self.levers
            ],
        }


def judge_tier(
    medium: Medium,
    prefix_kv_bytes: int,
    recompute_prefix_s: float,
    tp_degree: int,
    break_even_bytes_per_s: float,
    batch_slack: float,
) -> TierVerdict:
    fetch_time_s = fetch_s(prefix_kv_bytes, medium.bandwidth_bytes_per_s)
    fetch_gpu_s = 0.0  # moved by a copy engine, NIC or storage controller, not by GPU cores
    recompute_gpu_s = recompute_prefix_s * tp_degree
    helps_latency = fetch_time_s < recompute_prefix_s
    helps_capacity = fetch_gpu_s < recompute_gpu_s
    if helps_latency:
        verdict = Verdict.BUILD
    elif helps_capacity and fetch_time_s <= batch_slack * recompute_prefix_s:
        verdict = Verdict.BATCH_ONLY
    else:
        verdict = Verdict.NEVER
    return TierVerdict(
        medium=medium,
        fetch_s=fetch_time_s,
        margin=medium.bandwidth_bytes_per_s / break_even_bytes_per_s,
        helps_latency=helps_latency,
        helps_capacity=helps_capacity,
        fetch_gpu_s=fetch_gpu_s,
        recompute_gpu_s=recompute_gpu_s,
        verdict=verdict,
    )


def plan(
    model: ModelProfile,
    kv_dtype: KVDtype,
    gpu: GpuProfile,
    tp_degree: int,
    prefix_tokens: int,
    media: Sequence[str] = DEFAULT_MEDIA,
    bandwidth_overrides_bytes_per_s: Mapping[str, float] | None = None,
    batch_slack: float = DEFAULT_BATCH_SLACK,
    with_levers: bool = True,
) -> BreakEvenPlan:
    """The whole break-even picture for one model, dtype, GPU and TP degree."""
    check_tp_degree(model, tp_degree)
    if not isinstance(prefix_tokens, int) or prefix_tokens <= 0:
        raise ValueError(
            f"prefix length must be a positive number of tokens, got {prefix_tokens!r}"
        )
    if not batch_slack > 0 or batch_slack == float("inf"):
        raise ValueError(f"batch slack must be a positive finite factor, got {batch_slack!r}")
    overrides = dict(bandwidth_overrides_bytes_per_s or {})
    unknown = set(overrides) - set(media)
    if unknown:
        raise ValueError(
            f"bandwidth given for {', '.join(sorted(unknown))}, which is not among the media "
            f"planned ({', '.join(media)})"
        )

    per_token_bytes = kv_bytes_per_token(model, kv_dtype)
    per_token_s = recompute_s_per_token(model, gpu, tp_degree)
    prefix_bytes = per_token_bytes * prefix_tokens
    prefix_s = per_token_s * prefix_tokens
    threshold = break_even_bandwidth(model, kv_dtype, gpu, tp_degree)
    tiers = tuple(
        judge_tier(
            medium_for(name, gpu, overrides.get(name)),
            prefix_bytes,
            prefix_s,
            tp_degree,
            threshold,
            batch_slack,
        )
        for name in media
    )
    sweep = tuple(
        TpPoint(
            tp,
            recompute_s_per_token(model, gpu, tp),
            break_even_bandwidth(model, kv_dtype, gpu, tp),
        )
        for tp in DEFAULT_TP_SWEEP
        if model.mla is not None or model.num_kv_heads % tp == 0
    )
    result = BreakEvenPlan(
        model=model,
        kv_dtype=kv_dtype,
        gpu=gpu,
        tp_degree=tp_degree,
        prefix_tokens=prefix_tokens,
        batch_slack=batch_slack,
        kv_bytes_per_token=per_token_bytes,
        prefix_kv_bytes=prefix_bytes,
        recompute_s_per_token=per_token_s,
        recompute_prefix_s=prefix_s,
        recompute_prefix_gpu_s=prefix_s * tp_degree,
        break_even_bytes_per_s=threshold,
        tp_sweep=sweep,
        tiers=tiers,
        levers=(),
    )
    if not with_levers:
        return result
    levers = _levers(result, media, overrides)
    return replace(result, levers=levers)


def _levers(
    base: BreakEvenPlan, media: Sequence[str], overrides: Mapping[str, float]
) -> tuple[Lever, ...]:
    """What each of the design's three levers does to the break-even and to the verdicts."""
    candidates: list[tuple[str, str, ModelProfile, KVDtype, int]] = []
    if base.kv_dtype is not KVDtype.FP8:
        candidates.append(("fp8-kv", "store KV in FP8", base.model, KVDtype.FP8, base.tp_degree))
    doubled = base.tp_degree * 2
    if base.model.mla is not None or base.model.num_kv_heads % doubled == 0:
        candidates.append(
            ("tp-x2", f"TP{base.tp_degree} -> TP{doubled}", base.model, base.kv_dtype, doubled)
        )
    if base.model.mla is None:
        mla_model = replace(base.model, name=f"{base.model.name}+mla", mla=REFERENCE_MLA)
        candidates.append(
            (
                "mla",
                "an MLA latent of 512+64 per layer instead of GQA K and V",
                mla_model,
                base.kv_dtype,
                base.tp_degree,
            )
        )
    levers = []
    for name, description, model, dtype, tp in candidates:
        other = plan(
            model,
            dtype,
            base.gpu,
            tp,
            base.prefix_tokens,
            media,
            overrides,
            base.batch_slack,
            with_levers=False,
        )
        flips = tuple(
            (before.medium.name, before.verdict, after.verdict)
            for before, after in zip(base.tiers, other.tiers, strict=True)
            if before.verdict is not after.verdict
        )
        levers.append(
            Lever(
                name,
                description,
                other.break_even_bytes_per_s,
                other.break_even_bytes_per_s / base.break_even_bytes_per_s,
                flips,
            )
        )
    return tuple(levers)
