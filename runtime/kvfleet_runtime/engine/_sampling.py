"""Sampling: greedy at temperature 0, otherwise seeded multinomial sampling per request.

Order of operations on one step's logits (OpenAI's definitions): `logit_bias` is added, then
the presence and frequency penalties over the tokens generated so far are subtracted
(`logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`); log-probabilities
are reported from this distribution; then temperature and `top_p` shape what is sampled.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Sampled", "Sampler", "SamplingParams"]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy (argmax, first index on ties)."""
    seed: int | None = None
    """With a seed, the same request gives the same tokens (same replica, same batch shape)."""
    ignore_eos: bool = False
    top_p: float = 1.0
    """Sample from the smallest set of most likely tokens whose probability reaches top_p."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""
    logprobs: int | None = None
    """Report the sampled token's log-probability and this many top alternatives; None: off."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")


@dataclass(slots=True, frozen=True)
class Sampled:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most likely tokens and their log-probabilities, best first (when asked for)."""


class Sampler:
    """One per request: owns the request's random generator (on CPU, so seeds are portable)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.temperature = params.temperature
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: Tensor, generated: Sequence[int] = ()) -> int:
        return self.step(logits, generated).token_id

    def step(self, logits: Tensor, generated: Sequence[int] = ()) -> Sampled:
        """The next token of a sequence that has generated `generated` so far."""
        # logits: [V]
        p = self.params
        logits = logits.detach().to("cpu", torch.float32)
        if p.logit_bias or p.presence_penalty or p.frequency_penalty:
            logits = logits.clone()
            vocab = logits.shape[-1]
            for token, bias in p.logit_bias:
                if 0 <= token < vocab:
                    logits[token] += bias
            if generated and (p.presence_penalty or p.frequency_penalty):
                for token, count in Counter(generated).items():
                    if 0 <= token < vocab:
                        logits[token] -= count * p.frequency_penalty + p.presence_penalty
        token = self._choose(logits)
        if p.logprobs is None:
            return Sampled(token)
        logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = torch.topk(logp, min(p.logprobs, logp.shape[-1]))
            top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(),
                                                            strict=True))
        return Sampled(token, float(logp[token]), top)

    def _choose(self, logits: Tensor) -> int:
        if self.temperature == 0.0:
            return int(torch.argmax(logits).item())
        # Shift first and divide in float64: a tiny temperature (1e-300 underflows to 0 in
        # float32) then sends every other logit to -inf and the best to 0, never to nan.
        shifted = (logits - logits.max()).to(torch.float64)
        probs = torch.softmax(shifted / self.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep a token while the mass before it is under top_p: the best is always kept.
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs[before >= self.params.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
