"""vLLM's sampling extensions through the replica's HTTP API, on the chain checkpoint (greedy
walks a known chain of ids to the model's EOS): what each one changes, exactly."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvfleet_runtime.tokenizer import HFTokenizer
from tests.runtime.server.conftest import RunningReplica
from tests.runtime.server.test_api import client
from tests.runtime.server.test_tokenizer_serving import ANSWER, PROMPT, served  # noqa: F401
from tests.runtime.tokenizer.conftest import bpe_dir, spm_dir  # noqa: F401 (fixtures)

Served = tuple[str, list[int], HFTokenizer]


def _complete(base_url: str, **extra: Any) -> Any:
    c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                      default_headers={"X-Kvfleet-Tenant": "default"})
    return c.completions.create(model="m", prompt=PROMPT, max_tokens=20, temperature=0,
                                extra_body=extra)


def _ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_ignore_eos_generates_past_the_eos(served: Served) -> None:  # noqa: F811
    base_url, chain, _ = served
    out = _complete(base_url, ignore_eos=True).choices[0]
    assert out.finish_reason == "length" and len(_ids(out)) == 20
    assert _ids(out)[:len(chain) - 1] == chain[1:]


def test_min_tokens_holds_the_eos_back(served: Served) -> None:  # noqa: F811
    base_url, chain, _ = served
    n = len(chain) + 2
    out = _complete(base_url, min_tokens=n).choices[0]
    assert len(_ids(out)) >= n and chain[-1] not in _ids(out)[:n]
    assert _ids(out)[:len(chain) - 2] == chain[1:-1]


def test_stop_token_ids_end_the_answer_without_their_text(served: Served) -> None:  # noqa: F811
    base_url, chain, tok = served
    out = _complete(base_url, stop_token_ids=[chain[3]]).choices[0]
    assert out.finish_reason == "stop" and _ids(out) == chain[1:4]
    assert out.text == tok.decode(chain[1:3])
    kept = _complete(base_url, stop_token_ids=[chain[3]], include_stop_str_in_output=True)
    assert kept.choices[0].text == tok.decode(chain[1:4])


def test_include_stop_str_in_output_returns_the_stop_string(served: Served) -> None:  # noqa: F811
    base_url, _, _ = served
    assert _complete(base_url, stop=["你"]).choices[0].text == "🙂"
    out = _complete(base_url, stop=["你"], include_stop_str_in_output=True).choices[0]
    assert out.text == "🙂你" and out.finish_reason == "stop"


def test_skip_special_tokens_false_keeps_the_eos_text(served: Served) -> None:  # noqa: F811
    base_url, _, tok = served
    assert tok.eos_token is not None
    assert _complete(base_url, skip_special_tokens=False).choices[0].text == ANSWER
    out = _complete(base_url, skip_special_tokens=False, include_stop_str_in_output=True)
    assert out.choices[0].text == ANSWER + tok.eos_token
    plain = _complete(base_url, include_stop_str_in_output=True)
    assert plain.choices[0].text == ANSWER  # skipped: a special token is not text


def test_truncate_prompt_tokens_keeps_the_last_tokens(served: Served) -> None:  # noqa: F811
    base_url, chain, tok = served
    # The chain depends only on the last token, so the last one alone gives the same answer.
    out = _complete(base_url, truncate_prompt_tokens=1)
    assert out.usage.prompt_tokens == 1 and _ids(out.choices[0]) == chain[1:]
    right = _complete(base_url, truncate_prompt_tokens=1, truncation_side="right")
    assert right.usage.prompt_tokens == 1
    assert _ids(right.choices[0]) != chain[1:] or tok.encode(PROMPT)[0] == chain[0]
    whole = _complete(base_url, truncate_prompt_tokens=-1)
    assert whole.usage.prompt_tokens == len(tok.encode(PROMPT))


def test_a_prompt_over_the_limit_is_refused_even_when_it_asks_to_be_truncated(
        running: RunningReplica) -> None:
    # The published schema bounds the prompt as sent (`maxItems`: limits.max_prompt_tokens,
    # 256 here); truncation does not lift it (the schema fuzzer sent 256 + ids with
    # truncate_prompt_tokens and got a 200).
    c = client(running)
    truncate = {"truncate_prompt_tokens": 8}
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt=[5] * 257, max_tokens=2, extra_body=truncate)
    assert err.value.code == "prompt_too_long"
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny", max_tokens=2, extra_body=truncate,
                                  messages=[{"role": "user", "content": "x" * 300}])
    assert err.value.code == "prompt_too_long"
    out = c.completions.create(model="tiny", prompt=[5] * 256, max_tokens=2, extra_body=truncate)
    assert out.usage is not None and out.usage.prompt_tokens == 8


@pytest.mark.parametrize(("extra", "param"), [
    ({"min_tokens": 21}, "min_tokens"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_or_unsupported_extensions_are_a_400_naming_them(
        served: Served, extra: dict[str, Any], param: str) -> None:  # noqa: F811
    base_url, _, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        _complete(base_url, **extra)
    assert param in str(err.value)


def test_the_defaults_vllm_clients_send_are_accepted(served: Served) -> None:  # noqa: F811
    base_url, chain, _ = served
    defaults = {"repetition_penalty": 1.0, "top_k": -1, "min_p": 0.0, "use_beam_search": False,
                "length_penalty": 1.0, "stop_token_ids": [], "bad_words": [],
                "allowed_token_ids": None, "skip_special_tokens": True,
                "spaces_between_special_tokens": True, "priority": 0, "logprobs": None}
    assert _ids(_complete(base_url, **defaults).choices[0]) == chain[1:]


def test_chat_takes_the_same_extensions(running: RunningReplica) -> None:
    c = client(running)
    messages: list[Any] = [{"role": "user", "content": "Say something"}]

    def chat(**extra: Any) -> tuple[str, Any]:
        out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                        temperature=extra.pop("temperature", 0),
                                        extra_body=extra)
        return out.choices[0].message.content or "", out

    greedy, _ = chat()
    assert chat(temperature=1.0, top_k=1, seed=3)[0] == greedy
    assert chat(temperature=1.0, min_p=1.0, seed=4)[0] == greedy
    assert chat(repetition_penalty=1.8)[0] != greedy
    _, out = chat(ignore_eos=True, min_tokens=12, truncate_prompt_tokens=5)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(
        running: RunningReplica) -> None:
    chunks = list(client(running).completions.create(
        model="tiny", prompt="Count", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    usages = [ch.usage for ch in chunks]
    assert all(u is not None for u in usages)
    counts = [u.completion_tokens for u in usages if u is not None]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6
