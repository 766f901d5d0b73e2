"""vLLM's sampling extensions through the engine, against transformers' `generate` on the same
checkpoint: greedy with a repetition penalty gives generate's tokens; sampled with top-k, min-p
and a repetition penalty, every token is one transformers' processors leave possible."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvfleet_runtime.engine import GenerationRequest, SamplingParams
from kvfleet_runtime.model import LoadedModel

from .conftest import EngineFactory

transformers = pytest.importorskip("transformers")

PROMPT = tuple((11 * i + 3) % 256 for i in range(21))


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


def _generate(make_engine: EngineFactory, params: SamplingParams) -> list[int]:
    async def main() -> list[int]:
        engine = make_engine()
        await engine.start()
        try:
            tokens, _ = await engine.generate(GenerationRequest("t", PROMPT, params))
            return tokens
        finally:
            await engine.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_with_repetition_penalty_equals_generate(
        make_engine: EngineFactory, hf_model: object, loaded: LoadedModel,
        penalty: float) -> None:
    ours = _generate(make_engine, SamplingParams(max_tokens=24, repetition_penalty=penalty))
    ids = torch.tensor([PROMPT])
    out = hf_model.generate(ids, max_new_tokens=24, do_sample=False,  # type: ignore[attr-defined]
                            repetition_penalty=penalty, pad_token_id=0, eos_token_id=None)
    assert ours == out[0, len(PROMPT):].tolist()
    plain = _generate(make_engine, SamplingParams(max_tokens=24))
    assert plain != ours  # the penalty changed the answer: the case tests something


def test_sampled_tokens_are_in_transformers_support(make_engine: EngineFactory,
                                                    hf_model: object) -> None:
    temperature, penalty, top_k, min_p = 1.0, 1.3, 6, 0.7
    processors = transformers.LogitsProcessorList([
        transformers.RepetitionPenaltyLogitsProcessor(penalty),
        transformers.TemperatureLogitsWarper(temperature),
        transformers.TopKLogitsWarper(top_k),
        transformers.MinPLogitsWarper(min_p)])
    narrowed = 0
    for seed in range(3):
        ours = _generate(make_engine, SamplingParams(
            max_tokens=16, temperature=temperature, repetition_penalty=penalty, top_k=top_k,
            min_p=min_p, seed=seed))
        seq = torch.tensor([[*PROMPT, *ours]])
        with torch.no_grad():
            logits = hf_model(seq).logits[0].float()  # type: ignore[operator]
        for step, token in enumerate(ours):
            pos = len(PROMPT) + step
            scores = processors(seq[:, :pos], logits[pos - 1].unsqueeze(0))[0]
            allowed = torch.nonzero(torch.isfinite(scores)).flatten().tolist()
            assert token in allowed, f"seed {seed} step {step}: {token} not in {allowed}"
            narrowed += len(allowed) < top_k
    assert narrowed > 0  # min_p cut below top_k somewhere: both filters were exercised
