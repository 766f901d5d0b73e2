"""Built-in profiles: models, KV dtypes, GPUs and storage media for the break-even arithmetic.

Bandwidths are decimal (GB/s = 1e9 B/s) as vendors quote them; sizes of KV are binary (KiB, MiB)
as the design's tables show them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

GB = 1_000_000_000
TFLOPS = 1e12


class KVDtype(Enum):
    """The element type KV is stored in; its width is the only thing the arithmetic needs."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def bytes_per_element(self) -> int:
        return _DTYPE_BYTES[self]

    @classmethod
    def parse(cls, name: str) -> KVDtype:
        try:
            return cls(name.strip().lower())
        except ValueError:
            choices = ", ".join(d.value for d in cls)
            raise ValueError(f"unknown KV dtype {name!r}; choose one of: {choices}") from None


_DTYPE_BYTES = {KVDtype.FP32: 4, KVDtype.BF16: 2, KVDtype.FP16: 2, KVDtype.FP8: 1}


@dataclass(frozen=True, slots=True)
class MLAShape:
    """Multi-head latent attention: one compressed latent (plus the RoPE part) per layer and token,
    shared by K and V, instead of per-head K and V."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def elements_per_layer(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What the arithmetic needs of a model. `num_params` counts the parameters a token's forward
    pass touches (the activated parameters of a mixture-of-experts model)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    mla: MLAShape | None = None
    description: str = ""
    num_q_heads: int | None = None
    """Query heads: the attention term of `prefill_flops`, which grows with the position (None:
    not modelled, a token costs the 2N of its dense layers wherever it is)."""

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"model {self.name!r}: {field_name} must be a positive integer, got {value!r}"
                )
        if not math.isfinite(self.num_params) or self.num_params <= 0:
            raise ValueError(
                f"model {self.name!r}: num_params must be positive, got {self.num_params!r}"
            )
        if self.num_q_heads is not None and (
            not isinstance(self.num_q_heads, int) or self.num_q_heads <= 0
        ):
            raise ValueError(
                f"model {self.name!r}: num_q_heads must be a positive integer, got "
                f"{self.num_q_heads!r}"
            )
        if self.mla is not None and (self.mla.kv_lora_rank <= 0 or self.mla.qk_rope_head_dim < 0):
            raise ValueError(f"model {self.name!r}: invalid MLA latent dims {self.mla!r}")


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    dense_flops: float
    hbm_bandwidth_bytes_per_s: float
    description: str = ""

    def __post_init__(self) -> None:
        _require_positive(f"GPU {self.name!r} dense FLOPS", self.dense_flops)
        _require_positive(f"GPU {self.name!r} HBM bandwidth", self.hbm_bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True)
class Medium:
    """A place cached KV can be fetched from. `hbm` media take their bandwidth from the GPU."""

    name: str
    tier: str
    bandwidth_bytes_per_s: float
    description: str

    def __post_init__(self) -> None:
        _require_positive(f"medium {self.name!r} bandwidth", self.bandwidth_bytes_per_s)


def _require_positive(what: str, value: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")


MODELS: dict[str, ModelProfile] = {
    m.name: m
    for m in (
        ModelProfile(
            "reference-70b",
            80,
            8,
            128,
            70e9,
            description="the design's reference: 70B dense, 80 layers, GQA-8, head_dim 128",
            num_q_heads=64,
        ),
        ModelProfile(
            "llama-3-8b",
            32,
            8,
            128,
            8.03e9,
            description="Llama-3-8B: 32 layers, GQA-8, head_dim 128",
            num_q_heads=32,
        ),
        ModelProfile(
            "llama-3-405b",
            126,
            8,
            128,
            405e9,
            description="Llama-3-405B-like dense: 126 layers, GQA-8, head_dim 128",
            num_q_heads=128,
        ),
        ModelProfile(
            "deepseek-v3",
            61,
            128,
            128,
            37e9,
            mla=MLAShape(512, 64),
            description="DeepSeek-V3-like MLA MoE: 61 layers, latent 512+64, 37B activated of 671B",
            num_q_heads=128,
        ),
    )
}

GPUS: dict[str, GpuProfile] = {
    g.name: g
    for g in (
        GpuProfile("h100", 989.5 * TFLOPS, 3350 * GB, "H100 SXM, BF16 dense, HBM3 3.35 TB/s"),
        GpuProfile("h200", 989.5 * TFLOPS, 4800 * GB, "H200 SXM, BF16 dense, HBM3e 4.8 TB/s"),
        GpuProfile("a100", 312 * TFLOPS, 2039 * GB, "A100 SXM 80GB, BF16 dense, HBM2e 2.04 TB/s"),
        GpuProfile("b200", 2250 * TFLOPS, 8000 * GB, "B200, BF16 dense, HBM3e 8 TB/s"),
    )
}

# HBM's bandwidth is the GPU's; the 0 placeholder below is replaced by `media_for(gpu)`.
_HBM = "hbm"
MEDIA: dict[str, Medium] = {
    m.name: m
    for m in (
        Medium(_HBM, "T0", 1.0, "GPU HBM (bandwidth of the selected GPU)"),
        Medium("dram-pcie5", "T1", 64 * GB, "host DRAM over PCIe Gen5 x16"),
        Medium("dram-pcie4", "T1", 32 * GB, "host DRAM over PCIe Gen4 x16"),
        Medium("rdma-400g", "T2", 50 * GB, "peer host over 400 GbE RDMA"),
        Medium("rdma-200g", "T2", 25 * GB, "peer host over 200 GbE RDMA"),
        Medium("rdma-100g", "T2", 12.5 * GB, "peer host over 100 GbE RDMA"),
        Medium("nvme-gen5", "T3", 14 * GB, "local NVMe Gen5"),
        Medium("nvme-gen4", "T3", 7 * GB, "local NVMe Gen4"),
        Medium("object-storage", "T4", 1 * GB, "object storage"),
    )
}

T = TypeVar("T")

# The rows of the design's media table, in its order.
DEFAULT_MEDIA = ("hbm", "dram-pcie5", "rdma-200g", "nvme-gen4", "object-storage")


def lookup_profile(kind: str, table: dict[str, T], name: str) -> T:
    try:
        return table[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; choose one of: {', '.join(table)}") from None


def medium_for(
    name: str, gpu: GpuProfile, bandwidth_override_bytes_per_s: float | None = None
) -> Medium:
    """The named medium, with HBM bound to the GPU and an optional measured bandwidth."""
    medium = lookup_profile("medium", MEDIA, name)
    bandwidth, description = medium.bandwidth_bytes_per_s, medium.description
    if medium.name == _HBM:
        bandwidth, description = gpu.hbm_bandwidth_bytes_per_s, f"GPU HBM ({gpu.name})"
    if bandwidth_override_bytes_per_s is not None:
        bandwidth, description = bandwidth_override_bytes_per_s, f"{description}, measured"
    return Medium(medium.name, medium.tier, bandwidth, description)
