"""Sampling: greedy at temperature 0, otherwise seeded multinomial sampling per request.

One step samples a whole batch (`sample_batch`): the logits of every sequence are shaped as one
[B, V] tensor, and only the draw itself is per row (each request owns its random generator, so a
seed gives the same tokens whatever else is in the batch). The order is vLLM's:

1. `logit_bias` is added; while a sequence has fewer than `min_tokens` tokens, its stop ids (the
   model's EOS ids and its own `stop_token_ids`) are masked to -inf;
2. penalties: `repetition_penalty` over the prompt and the tokens generated so far (a positive
   logit is divided by it, a negative one multiplied, as transformers and vLLM do), then
   OpenAI's `logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty` over
   the generated tokens;
3. log-probabilities are reported from this distribution;
4. temperature 0 takes the argmax; otherwise temperature, then `min_p` (drop tokens less likely
   than `min_p` times the best one), `top_k` (keep the k most likely; ties at the k-th value
   stay), then `top_p` over what is left, then the draw.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Sampled", "Sampler", "SamplingParams", "sample_batch"]


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 is greedy (argmax, first index on ties)."""
    seed: int | None = None
    """With a seed, the same request gives the same tokens (same replica, same batch shape)."""
    ignore_eos: bool = False
    """The model's EOS ids do not end the sequence (its `stop_token_ids` still do)."""
    top_p: float = 1.0
    """Sample from the smallest set of most likely tokens whose probability reaches top_p."""
    top_k: int = 0
    """Sample from the k most likely tokens; 0 (or -1, vLLM's other spelling) is off."""
    min_p: float = 0.0
    """Drop tokens whose probability is under min_p times the most likely one's; 0 is off."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """Over the prompt and the output: a positive logit / it, a negative one * it; 1 is off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""
    min_tokens: int = 0
    """No stop id (EOS or `stop_token_ids`) can be sampled before this many tokens."""
    stop_token_ids: frozenset[int] = frozenset()
    """The sequence ends ("stop") on any of these, besides the model's EOS ids."""
    logprobs: int | None = None
    """Report the sampled token's log-probability and this many top alternatives; None: off."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, frozen=True)
class Sampled:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most likely tokens and their log-probabilities, best first (when asked for)."""


class Sampler:
    """One per request: its parameters, its prompt (for the repetition penalty), the ids that
    `min_tokens` holds back, and its random generator (on CPU, so seeds are portable)."""

    def __init__(self, params: SamplingParams, *, prompt: Sequence[int] = (),
                 eos_ids: frozenset[int] = frozenset()) -> None:
        self.params = params
        self.temperature = params.temperature
        self.prompt_ids = tuple(prompt) if params.repetition_penalty != 1.0 else ()
        """Kept only when the repetition penalty needs them."""
        self.held_ids = tuple(sorted(eos_ids | params.stop_token_ids))
        """Masked while the output is shorter than `min_tokens` (vLLM masks EOS even when
        `ignore_eos` is set)."""
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: Tensor, generated: Sequence[int] = ()) -> int:
        return self.step(logits, generated).token_id

    def step(self, logits: Tensor, generated: Sequence[int] = ()) -> Sampled:
        """The next token of a sequence that has generated `generated` so far (logits: [V])."""
        return sample_batch([self], logits.unsqueeze(0), [generated])[0]


def _rows_where(flags: Sequence[bool]) -> list[int]:
    return [i for i, f in enumerate(flags) if f]


def _processed_logits(samplers: Sequence[Sampler], logits: Tensor,
                      generated: Sequence[Sequence[int]]) -> Tensor:
    """Steps 1 and 2 of the module docstring, on a float32 CPU copy: [B, V]."""
    params = [s.params for s in samplers]
    logits = logits.detach().to("cpu", torch.float32).clone()
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
            bias = torch.tensor([b for t, b in p.logit_bias if 0 <= t < vocab])
            logits[i].index_add_(0, ids, bias)
    held = [i for i, (s, out) in enumerate(zip(samplers, generated, strict=True))
            if len(out) < s.params.min_tokens and s.held_ids]
    for i in held:
        ids = torch.tensor([t for t in samplers[i].held_ids if 0 <= t < vocab], dtype=torch.long)
        logits[i, ids] = float("-inf")
    penalized = _rows_where([p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                             or p.presence_penalty != 0.0 for p in params])
    if not penalized:
        return logits
    # Counts of each row's generated tokens, one scatter for the rows that need them; the pad
    # (and any id outside the vocabulary) goes to an extra column that is dropped.
    width = max((len(generated[i]) for i in penalized), default=0)
    out_ids = torch.full((len(penalized), max(width, 1)), vocab, dtype=torch.long)
    for r, i in enumerate(penalized):
        row_ids = [t if 0 <= t < vocab else vocab for t in generated[i]]
        out_ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
    counts = torch.zeros(len(penalized), vocab + 1).scatter_add_(
        1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))[:, :vocab]
    rows = logits[penalized]
    # A penalty is only bounded above 0: one under float32's smallest normal would round to 0
    # here (and -inf * 0, a held stop id, is nan), and dividing by a tiny one overflows to +inf
    # (and inf - inf is nan when the distribution is shifted). Kept normal, and the rows
    # saturated at float32's largest value below, the arithmetic stays exact for every other
    # penalty and the most repeated tokens simply win.
    rep = torch.tensor([params[i].repetition_penalty for i in penalized]).unsqueeze(1)
    rep = rep.clamp(min=torch.finfo(torch.float32).tiny)
    seen = counts > 0
    for r, i in enumerate(penalized):
        prompt = [t for t in samplers[i].prompt_ids if 0 <= t < vocab]
        if prompt:
            seen[r, torch.tensor(prompt, dtype=torch.long)] = True
    repeated = seen & (rep != 1.0)
    rows = torch.where(repeated, torch.where(rows > 0, rows / rep, rows * rep), rows)
    freq = torch.tensor([params[i].frequency_penalty for i in penalized]).unsqueeze(1)
    presence = torch.tensor([params[i].presence_penalty for i in penalized]).unsqueeze(1)
    rows = rows - counts * freq - (counts > 0).float() * presence
    logits[penalized] = rows.clamp(max=torch.finfo(torch.float32).max)
    return logits


def sampling_probs(samplers: Sequence[Sampler], logits: Tensor) -> Tensor:
    """Step 4 before the draw, for rows of non-zero temperature: float64 [B, V], each row the
    distribution that is sampled (unnormalized where nothing was filtered)."""
    params = [s.params for s in samplers]
    # Shift first and divide in float64: a tiny temperature (1e-300 underflows to 0 in float32)
    # then sends every other logit to -inf and the best to 0, never to nan.
    shifted = (logits - logits.max(dim=-1, keepdim=True).values).to(torch.float64)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float64).unsqueeze(1)
    probs = torch.softmax(shifted / temps, dim=-1)
    filtered = False
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64).unsqueeze(1)
    if bool((min_p > 0).any()):
        best = probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < best * min_p, 0.0, probs)
        filtered = True
    vocab = probs.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k_max = max(ks)
        top = torch.topk(probs, k_max, dim=-1).values  # [B, k_max], best first
        index = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long).unsqueeze(1)
        kth = top.gather(1, index)
        kth = torch.where(torch.tensor(ks).unsqueeze(1) > 0, kth, 0.0)
        probs = torch.where(probs < kth, 0.0, probs)
        filtered = True
    if filtered:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64).unsqueeze(1)
    if bool((top_p < 1.0).any()):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token while the mass before it is under top_p: the best is always kept.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(before >= top_p, 0.0, sorted_probs)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample_batch(samplers: Sequence[Sampler], logits: Tensor,
                 generated: Sequence[Sequence[int]]) -> list[Sampled]:
    """The next token of each sequence: `logits` [B, V], row i for `samplers[i]`, which has
    generated `generated[i]` so far."""
    assert logits.dim() == 2 and logits.shape[0] == len(samplers) == len(generated)
    logits = _processed_logits(samplers, logits, generated)
    tokens = torch.argmax(logits, dim=-1).tolist()  # first index on ties
    drawn = _rows_where([not s.params.greedy for s in samplers])
    if drawn:
        probs = sampling_probs([samplers[i] for i in drawn], logits[drawn])
        for r, i in enumerate(drawn):
            tokens[i] = int(torch.multinomial(probs[r], 1, generator=samplers[i]._generator))
    out: list[Sampled] = []
    wanted = _rows_where([s.params.logprobs is not None for s in samplers])
    logp = torch.log_softmax(logits[wanted].to(torch.float64), dim=-1) if wanted else None
    rows = dict(zip(wanted, range(len(wanted)), strict=True))
    for i, s in enumerate(samplers):
        n = s.params.logprobs
        if n is None or logp is None:
            out.append(Sampled(tokens[i]))
            continue
        row = logp[rows[i]]
        top: tuple[tuple[int, float], ...] = ()
        if n:
            values, ids = torch.topk(row, min(n, row.shape[-1]))
            top = tuple((int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist(),
                                                            strict=True))
        out.append(Sampled(tokens[i], float(row[tokens[i]]), top))
    return out
