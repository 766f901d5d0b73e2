"""The sampler's OpenAI parameters on hand-made logits: exact arithmetic, exact choices."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet_runtime.engine import Sampler, SamplingParams, sample_batch

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


# ---- vLLM's extensions, against transformers' own processors ---------------------------------

def _hf_probs(logits: torch.Tensor, history: list[int], *, temperature: float, penalty: float,
              top_k: int, min_p: float) -> torch.Tensor:
    """What transformers' generate samples from: its processors, in its order."""
    tf = pytest.importorskip("transformers")
    ids = torch.tensor([history])
    scores = logits.clone().unsqueeze(0)
    processors = [tf.RepetitionPenaltyLogitsProcessor(penalty),
                  tf.TemperatureLogitsWarper(temperature)]
    if top_k:
        processors.append(tf.TopKLogitsWarper(top_k))
    if min_p:
        processors.append(tf.MinPLogitsWarper(min_p))
    for proc in processors:
        scores = proc(ids, scores)
    return torch.softmax(scores.to(torch.float64), dim=-1)[0]


CASES = [  # (temperature, repetition_penalty, top_k, min_p)
    (1.0, 1.3, 0, 0.0),
    (0.7, 1.0, 5, 0.0),
    (1.0, 1.0, 0, 0.2),
    (0.8, 1.7, 7, 0.05),
    (1.3, 0.8, 3, 0.0),  # a penalty under 1 favours repeats
]


def test_a_batch_samples_from_transformers_distributions() -> None:
    from kvfleet_runtime.engine._sampling import _processed_logits, sampling_probs

    gen = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(len(CASES), vocab, generator=gen) * 3
    prompts = [torch.randint(0, vocab, (8 + i,), generator=gen).tolist() for i in range(5)]
    outputs = [torch.randint(0, vocab, (i,), generator=gen).tolist() for i in range(5)]
    samplers = [Sampler(SamplingParams(temperature=t, repetition_penalty=r, top_k=k, min_p=m,
                                       seed=0), prompt=p)
                for (t, r, k, m), p in zip(CASES, prompts, strict=True)]
    processed = _processed_logits(samplers, logits, outputs)
    probs = sampling_probs(samplers, processed)
    for i, (t, r, k, m) in enumerate(CASES):
        expected = _hf_probs(logits[i], prompts[i] + outputs[i], temperature=t, penalty=r,
                             top_k=k, min_p=m)
        assert torch.equal(probs[i] > 0, expected > 0), f"case {i}: a different support"
        torch.testing.assert_close(probs[i], expected, rtol=1e-5, atol=1e-7)


def test_batch_rows_equal_rows_sampled_alone() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(CASES), 40, generator=gen)
    params = [SamplingParams(temperature=t, repetition_penalty=r, top_k=k, min_p=m, seed=7,
                             logprobs=2) for t, r, k, m in CASES]
    histories = [[1, 2, 3][:i] for i in range(len(CASES))]
    together = sample_batch([Sampler(p, prompt=[4, 5]) for p in params], logits, histories)
    alone = [Sampler(p, prompt=[4, 5]).step(row, h)
             for p, row, h in zip(params, logits, histories, strict=True)]
    assert [s.token_id for s in together] == [s.token_id for s in alone]
    for a, b in zip(together, alone, strict=True):
        assert a.logprob == pytest.approx(b.logprob)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([2.0, 1.5, -1.0, -1.2])
    # Token 0 was in the prompt: 2 / 2 = 1 < 1.5.
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0]).sample(logits) == 1
    # Token 2 generated: -1 * 2 = -2 < -1.2, so greedy among the last two prefers 3.
    biased = Sampler(SamplingParams(repetition_penalty=2.0, logit_bias=((0, -9.0), (1, -9.0))))
    assert biased.sample(logits, [2]) == 3


@pytest.mark.parametrize("penalty", [3.0342052881773387e-227, 1e-40, 1e-30])
def test_a_vanishing_repetition_penalty_samples_a_repeated_token(penalty: float) -> None:
    """A penalty is only bounded above 0 (the fuzzer sent 3e-227): dividing by it overflowed
    float32 and the draw failed on nan probabilities, a 500. The repeated tokens win."""
    logits = torch.tensor([2.0, 1.5, -1.0, 3.0])
    for s in range(5):
        params = SamplingParams(temperature=1.0, repetition_penalty=penalty, seed=s,
                                min_tokens=1, stop_token_ids=frozenset({2}))
        sampler = Sampler(params, prompt=[0, 1])
        assert sampler.sample(logits, []) in (0, 1)
        assert sampler.sample(logits, [2]) in (0, 1)
    greedy = Sampler(SamplingParams(repetition_penalty=penalty, logprobs=2), prompt=[0, 1])
    (sampled,) = sample_batch([greedy], logits.unsqueeze(0), [[]])
    assert sampled.token_id == 0 and sampled.logprob is not None and math.isfinite(sampled.logprob)
    assert all(math.isfinite(lp) for _, lp in sampled.top_logprobs)


def test_top_k_one_and_min_p_one_are_greedy() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    for s in range(30):
        assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=s)).sample(logits) == 1
        assert Sampler(SamplingParams(temperature=1.5, min_p=1.0, seed=s)).sample(logits) == 1


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([5.0, 1.0, 4.0, 0.0])
    params = SamplingParams(min_tokens=2, stop_token_ids=frozenset({2}))
    sampler = Sampler(params, eos_ids=frozenset({0}))
    assert sampler.sample(logits, []) == 1
    assert sampler.sample(logits, [1]) == 1
    assert sampler.sample(logits, [1, 1]) == 0  # reached: EOS may come


@pytest.mark.parametrize(("field", "value"), [("top_k", -2), ("min_p", 1.5),
                                              ("repetition_penalty", 0.0), ("min_tokens", 17)])
def test_bad_vllm_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
