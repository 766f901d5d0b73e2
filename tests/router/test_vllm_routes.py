"""vLLM's auxiliary routes on a replica and through the router: /tokenize (a prompt and chat
messages) and /detokenize with the model's own tokenizer, /v1/models with vLLM's fields,
/version and /health, in vLLM's shapes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from kvfleet_runtime import __version__
from kvfleet_runtime.tokenizer import ByteTokenizer
from tests.router.test_openai_fleet import Fleet, fleet  # noqa: F401 (fixture)

TEXT = "Hello, kvfleet"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def _call(url: str, body: dict[str, Any] | None = None, key: str | None = "sk-acme"
          ) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _json(url: str, body: dict[str, Any] | None = None, key: str | None = "sk-acme"
          ) -> dict[str, Any]:
    status, raw = _call(url, body, key)
    assert status == 200, raw
    out: dict[str, Any] = json.loads(raw)
    return out


@pytest.fixture(params=["replica", "router"])
def base(request: pytest.FixtureRequest, fleet: Fleet) -> str:  # noqa: F811
    if request.param == "router":
        return fleet.url
    return f"http://127.0.0.1:{fleet.replicas[0].port}"


def test_tokenize_a_prompt_with_the_models_tokenizer(base: str) -> None:
    tok = ByteTokenizer()
    out = _json(base + "/tokenize", {"model": "tiny", "prompt": TEXT})
    assert out == {"count": len(tok.encode(TEXT)), "max_model_len": 2048,
                   "tokens": tok.encode(TEXT), "token_strs": None}
    bare = _json(base + "/tokenize", {"prompt": TEXT, "add_special_tokens": False,
                                      "return_token_strs": True})
    assert bare["tokens"] == tok.encode(TEXT, bos=False)
    assert "".join(bare["token_strs"]) == TEXT


def test_tokenize_chat_messages_as_chat_completions_renders_them(base: str) -> None:
    tok = ByteTokenizer()
    out = _json(base + "/tokenize", {"model": "tiny", "messages": MESSAGES})
    assert out["tokens"] == tok.encode_chat(MESSAGES, add_generation_prompt=True)
    no_prompt = _json(base + "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert no_prompt["tokens"] == tok.encode_chat(MESSAGES, add_generation_prompt=False)


def test_detokenize_inverts_tokenize(base: str) -> None:
    ids = _json(base + "/tokenize", {"prompt": TEXT, "add_special_tokens": False})["tokens"]
    assert _json(base + "/detokenize", {"model": "tiny", "tokens": ids}) == {"prompt": TEXT}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/tokenize", {"prompt": TEXT, "model": "gpt-4o"}, "model"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{x}}"}, "chat_template"),
])
def test_bad_tokenizer_requests_are_4xx_naming_the_field(base: str, path: str,
                                                         body: dict[str, Any],
                                                         param: str) -> None:
    status, raw = _call(base + path, body)
    assert 400 <= status < 500, raw
    assert param in json.loads(raw)["error"]["message"]


def test_models_carry_vllms_fields(base: str, fleet: Fleet) -> None:  # noqa: F811
    card = _json(base + "/v1/models")["data"][0]
    assert card["id"] == "tiny" and card["parent"] is None and card["max_model_len"] == 2048
    assert card["root"] == fleet.replicas[0].replica.config.model_dir
    assert card["root"].endswith("tiny") and card["weights_digest"].startswith("sha256:")


def test_version_and_health(base: str) -> None:
    assert _json(base + "/version", key=None) == {"version": __version__}
    assert _call(base + "/health", key=None) == (200, b"")


def test_the_router_wants_an_api_key_for_the_tokenizer(fleet: Fleet) -> None:  # noqa: F811
    status, raw = _call(fleet.url + "/tokenize", {"prompt": TEXT}, key=None)
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
