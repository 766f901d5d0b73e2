"""The sampler's OpenAI parameters on hand-made logits: exact arithmetic, exact choices."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet_runtime.engine import Sampler, SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.0, -1.0])


def greedy(**kw: object) -> Sampler:
    return Sampler(SamplingParams(temperature=0.0, **kw))  # type: ignore[arg-type]


def test_logit_bias_moves_the_argmax() -> None:
    assert greedy().sample(LOGITS) == 0
    assert greedy(logit_bias=((3, 3.5),)).sample(LOGITS) == 3  # -1 + 3.5 = 2.5 > 2
    assert greedy(logit_bias=((3, 2.5),)).sample(LOGITS) == 0  # 1.5 < 2: ties go nowhere
    assert greedy(logit_bias=((999, 100.0),)).sample(LOGITS) == 0  # no such token: no effect


@pytest.mark.parametrize(
    ("frequency", "presence", "generated", "expected"),
    [
        (0.0, 0.0, [0, 0], 0),
        (0.3, 0.0, [0], 0),  # 2 - 0.3 = 1.7 > 1.5
        (0.3, 0.0, [0, 0], 1),  # 2 - 0.6 = 1.4 < 1.5
        (0.0, 0.6, [0, 0, 0], 1),  # presence counts once: 2 - 0.6 = 1.4
        (0.0, 0.4, [0, 0, 0], 0),  # 1.6
        (0.3, 0.4, [0, 1], 0),  # 2 - 0.7 = 1.3, 1.5 - 0.7 = 0.8, 1.0 untouched
        (-1.0, 0.0, [3, 3, 3, 3], 3),  # a negative penalty favours repeats: -1 + 4 = 3
    ],
)
def test_penalties_are_openai_arithmetic(
    frequency: float, presence: float, generated: list[int], expected: int
) -> None:
    sampler = greedy(frequency_penalty=frequency, presence_penalty=presence)
    assert sampler.sample(LOGITS, generated) == expected


def test_logprobs_are_of_the_biased_distribution_and_best_first() -> None:
    out = greedy(logprobs=2, logit_bias=((2, 1.0),)).step(LOGITS)
    biased = torch.tensor([2.0, 1.5, 2.0, -1.0], dtype=torch.float64)
    expected = torch.log_softmax(biased, dim=-1)
    assert out.token_id == 0 and out.logprob == pytest.approx(float(expected[0]))
    assert [i for i, _ in out.top_logprobs] == [0, 2]
    assert out.top_logprobs[1][1] == pytest.approx(float(expected[2]))
    assert math.fsum(math.exp(v) for v in expected.tolist()) == pytest.approx(1.0)
    assert greedy().step(LOGITS).logprob is None


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities at temperature 1: about [0.48, 0.29, 0.18, 0.02].
    seen = {Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s)).sample(LOGITS)
            for s in range(200)}
    assert seen == {0, 1}  # 0.48 < 0.5, so the second token is kept, the third never
    only = {Sampler(SamplingParams(temperature=1.0, top_p=0.4, seed=s)).sample(LOGITS)
            for s in range(50)}
    assert only == {0}


@pytest.mark.parametrize(("field", "value"), [("top_p", 0.0), ("top_p", 1.5), ("logprobs", 21)])
def test_bad_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
