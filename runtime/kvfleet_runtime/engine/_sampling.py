"""Sampling: greedy at temperature 0, otherwise seeded multinomial sampling per request."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Sampler", "SamplingParams"]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy (argmax, first index on ties)."""
    seed: int | None = None
    """With a seed, the same request gives the same tokens (same replica, same batch shape)."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")


class Sampler:
    """One per request: owns the request's random generator (on CPU, so seeds are portable)."""

    def __init__(self, params: SamplingParams) -> None:
        self.temperature = params.temperature
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: Tensor) -> int:
        # logits: [V]
        logits = logits.detach().to("cpu", torch.float32)
        if self.temperature == 0.0:
            return int(torch.argmax(logits).item())
        # Shift first and divide in float64: a tiny temperature (1e-300 underflows to 0 in
        # float32) then sends every other logit to -inf and the best to 0, never to nan.
        shifted = (logits - logits.max()).to(torch.float64)
        probs = torch.softmax(shifted / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
