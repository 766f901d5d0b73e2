"""The replica's OpenAI surface with the official client: chat, parameters, batch prompts, and
input that must never be a 5xx."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from kvfleet_runtime.tokenizer import ByteTokenizer
from kvfleet_runtime.wire import BLOCK_SIZE

from .conftest import TEST_CONFIG, RunningReplica, as_router
from .test_api import _wait_for, client, get, post

IDS = [(7 * i + 5) % 256 for i in range(24)]


def test_chat_completion_uses_the_chat_template(running: RunningReplica) -> None:
    c = client(running)
    messages: list[Any] = [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hi"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                     temperature=0)
    rendered = ByteTokenizer().encode_chat(messages, add_generation_prompt=True)
    plain = c.completions.create(model="tiny", prompt=rendered, max_tokens=5, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage is not None and chat.usage.prompt_tokens == len(rendered)
    assert chat.system_fingerprint == plain.system_fingerprint
    digest = running.replica.loaded.weights_digest
    assert chat.system_fingerprint == "fp_" + digest.removeprefix("sha256:")[:16]


def test_chat_stream_with_usage_equals_the_whole_answer(running: RunningReplica) -> None:
    c = client(running)
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "Tell "},
                                                         {"type": "text", "text": "me"}]}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                      temperature=0)
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # a prompt never sent before
    # The second sighting stores the prompt (TEST_CONFIG's admit_min_sightings), so the stream
    # below hits every whole block but the one holding the last prompt token.
    c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    expected_cached = (whole.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected_cached > 0, "the prompt must span a whole block for the hit to show"
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == whole.choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in chunks[:-1])
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == expected_cached


def test_models_retrieve(running: RunningReplica) -> None:
    c = client(running)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        c.models.retrieve("gpt-4")


def _greedy(running: RunningReplica, **kw: Any) -> Any:
    return client(running).completions.create(model="tiny", prompt=IDS, temperature=0, **kw)


def test_stop_ends_before_the_stop_string_streaming_or_not(running: RunningReplica) -> None:
    full = _greedy(running, max_tokens=12).choices[0]
    text = full.text
    # A stop string from the middle of the greedy answer (two characters, so it can span
    # tokens): the answer is cut right before its first occurrence.
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if "\ufffd" not in text[i:i + 2])
    cut = text[:text.find(stop)]
    requests = running.replica.engine.metrics.requests
    aborts = requests.labels("abort")._value.get()
    got = _greedy(running, max_tokens=12, stop=[stop, "never-seen"]).choices[0]
    assert got.text == cut and got.finish_reason == "stop"
    chunks = list(_greedy(running, max_tokens=12, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    _wait_for(lambda: running.replica.engine.num_running == 0)
    kv = running.replica.engine.kv
    _wait_for(lambda: kv.num_free_blocks == kv.num_blocks)
    assert requests.labels("abort")._value.get() == aborts  # a stop is a stop, not an abort


def test_n_choices_and_seeds(running: RunningReplica) -> None:
    c = client(running)
    a = c.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, n=3,
                             seed=7)
    b = c.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0, n=3,
                             seed=7)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) > 1  # choice i is seeded with seed + i
    one = c.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=1.0,
                               seed=8)
    assert one.choices[0].text == a.choices[1].text
    assert a.usage is not None and a.usage.prompt_tokens == 5 and a.usage.completion_tokens == 24


def test_batch_prompts_strings_and_id_lists(running: RunningReplica) -> None:
    c = client(running)
    texts = c.completions.create(model="tiny", prompt=["ab", "cde"], max_tokens=3, temperature=0,
                                 n=2)
    assert [ch.index for ch in texts.choices] == [0, 1, 2, 3]
    alone = c.completions.create(model="tiny", prompt="cde", max_tokens=3, temperature=0)
    assert texts.choices[2].text == texts.choices[3].text == alone.choices[0].text
    assert texts.usage is not None and texts.usage.prompt_tokens == 3 + 4
    ids = c.completions.create(model="tiny", prompt=[[1, 2, 3], IDS], max_tokens=3,
                               temperature=0)
    assert ids.choices[1].text == _greedy(running, max_tokens=3).choices[0].text


def test_logprobs_top_p_penalties_logit_bias_echo(running: RunningReplica) -> None:
    greedy = _greedy(running, max_tokens=6, logprobs=3)
    lp = greedy.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 6
    for token_lp, top in zip(lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
        # Greedy: the sampled token is the most likely one.
        assert token_lp <= 0 and len(top) <= 3 and token_lp == pytest.approx(max(top.values()))
    # top_p this small keeps only the best token: sampling at temperature 1 is greedy.
    nucleus = _greedy(running, max_tokens=6).choices[0].text
    assert client(running).completions.create(
        model="tiny", prompt=IDS, max_tokens=6, temperature=1.0, top_p=1e-9, seed=1
    ).choices[0].text == nucleus
    forced = _greedy(running, max_tokens=5, logit_bias={"65": 100}).choices[0]
    assert forced.text == "AAAAA"
    # Penalties are exact arithmetic on the logits (tests/runtime/engine/test_sampler.py);
    # here: accepted, and a penalty too small to beat a +100 bias changes nothing.
    penalised = _greedy(running, max_tokens=5, logit_bias={"65": 100}, frequency_penalty=2.0,
                        presence_penalty=2.0).choices[0]
    assert penalised.text == "AAAAA"
    echo = client(running).completions.create(model="tiny", prompt="Say", max_tokens=3,
                                              temperature=0, echo=True)
    plain = client(running).completions.create(model="tiny", prompt="Say", max_tokens=3,
                                               temperature=0)
    assert echo.choices[0].text == "Say" + plain.choices[0].text
    chat = client(running).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_completion_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, user="u-1")
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and len(content[0].top_logprobs) == 2


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]},
         400, "tools: tool calling is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_object"}},
         400, "response_format 'json_object' is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
         "messages.0.role"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages: List should have at least"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": 33}, 400,
         "max_tokens 33 exceeds the limit of 32"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix: suffix (insertion)"),
        ("/v1/completions", {"prompt": ["a", 1]}, 400, "prompt.1: Input should be a valid string"),
        ("/v1/completions", {"prompt": [[1], ["a"]]}, 400, "prompt.1.0"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"65": 101}}, 400, "logit_bias.65"),
        ("/v1/completions", {"prompt": "x\ud800"}, 400, "prompt: a lone surrogate U+D800"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, 400,
         "messages.0.content: a lone surrogate"),
        ("/v1/completions", {"prompt": [1], "seed": 10**5000}, 400,
         "an integer of 5001 digits (at most 20)"),
        ("/v1/completions", {"prompt": [1], "max_tokens": 2**64}, 400, "max_tokens"),
    ],
)
def test_refused_and_bad_parameters_name_the_field(
    running: RunningReplica, path: str, body: dict[str, Any], status: int, needle: str
) -> None:
    sys.set_int_max_str_digits(0)  # json.dumps of the 5,001-digit seed (the client side)
    try:
        resp = post(running, json.dumps(body).encode(), path=path)
    finally:
        sys.set_int_max_str_digits(4300)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["error"]["message"]


def test_deep_nesting_is_a_400(running: RunningReplica) -> None:
    resp = post(running, b"{\"prompt\": " + b"[" * 30_000 + b"]" * 30_000 + b"}")  # 60 KB
    assert resp.status_code == 400 and "nests deeper" in resp.json()["error"]["message"]


def test_prompt_plus_max_tokens_over_the_context_names_both(running: RunningReplica) -> None:
    replica = running.replica
    changed = json.loads(json.dumps(TEST_CONFIG))
    changed["limits"].update(max_prompt_tokens=2048, max_tokens=64)
    try:
        running.config_path.write_text(yaml.safe_dump(changed))
        _wait_for(lambda: replica.config.limits.max_tokens == 64)
        resp = post(running, {"prompt": [1] * 2040, "max_tokens": 16})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert error["message"] == ("prompt (2040 tokens) + max_tokens (16) = 2056 tokens "
                                    "exceeds the model's context of 2048 tokens")
    finally:
        running.config_path.write_text(yaml.safe_dump(TEST_CONFIG))
        _wait_for(lambda: replica.config.limits.max_tokens == 32)


def _raw_http(port: int, head: bytes, body: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_slow_body_is_a_408_and_the_connection_is_closed(running: RunningReplica) -> None:
    replica = running.replica
    changed = json.loads(json.dumps(TEST_CONFIG))
    changed["limits"]["body_read_timeout_s"] = 0.5
    try:
        running.config_path.write_text(yaml.safe_dump(changed))
        _wait_for(lambda: replica.config.limits.body_read_timeout_s == 0.5)
        port = int(running.base_url.rsplit(":", 1)[1])
        signed = as_router({"X-Kvfleet-Tenant": "acme"}, "POST",
                           running.base_url + "/v1/completions")
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                + b"".join(f"{k}: {v}\r\n".encode() for k, v in signed.items())
                + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        answer = _raw_http(port, head, b'{"prompt":')  # 10 of the 100 bytes announced
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout"
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["message"] == ("request body did not arrive within 0.5 s (10 bytes "
                                    "received of 100 announced)")
    finally:
        running.config_path.write_text(yaml.safe_dump(TEST_CONFIG))
        _wait_for(lambda: replica.config.limits.body_read_timeout_s == 10.0)


async def _abandon_stream(base_url: str) -> int:
    body = {"prompt": IDS, "max_tokens": 32, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(
        base_url + "/v1/completions", json=body,
        headers=as_router({"X-Kvfleet-Tenant": "gone"}, "POST", base_url + "/v1/completions")
    ) as resp:
        await resp.content.readline()  # the first event arrived: generation is under way
        status = resp.status
    return status  # leaving the block closes the connection mid-stream


def test_a_client_that_goes_away_is_a_cancel_not_an_error(
    running: RunningReplica, caplog: pytest.LogCaptureFixture
) -> None:
    engine = running.replica.engine
    before = engine.metrics.requests.labels("abort")._value.get()
    with caplog.at_level(logging.DEBUG):
        assert asyncio.run(_abandon_stream(running.base_url)) == 200
        _wait_for(lambda: engine.metrics.requests.labels("abort")._value.get() == before + 1)
        _wait_for(lambda: engine.num_running == 0)
        time.sleep(0.2)  # let the server log whatever it would log about the closed stream
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("client went away" in r.getMessage() for r in caplog.records)
    assert get(running.base_url + "/healthz").status_code == 200
