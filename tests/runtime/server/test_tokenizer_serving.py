"""A replica serving a folder with a real tokenizer: text prompts are encoded with it, text comes
back whole through the official openai client (streamed or not), and generation stops on the
tokenizer's stop ids.

The checkpoint is built so that greedy decoding walks a known chain of ids: every attention and
MLP output projection is zero (the residual stream is the current token's embedding) and row
`next` of lm_head is the embedding of `prev`, so token `prev` is followed by `next`. The chain
spells an emoji (several byte tokens) and CJK, then the model's EOS.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.server import build_replica, load_config
from kvfleet_runtime.tokenizer import HFTokenizer, load_tokenizer
from tests.runtime.server.conftest import TEST_CONFIG, ServerThread
from tests.runtime.tokenizer.conftest import bpe_dir, spm_dir  # noqa: F401 (fixtures)

pytest.importorskip("transformers")

PROMPT = "Hello world"
ANSWER = "🙂你好"


def _chain_checkpoint(out: Path, tokenizer_dir: Path, stop_id: int) -> list[int]:
    tok = load_tokenizer(tokenizer_dir)
    assert isinstance(tok, HFTokenizer)
    args = dataclasses.replace(ModelArgs.from_preset("tiny"), vocab_size=tok.vocab_size + 3)
    generate_checkpoint(out, args, seed=0)
    chain = [tok.encode(PROMPT)[-1], *tok.encode(ANSWER, bos=False), stop_id]
    assert len(set(chain)) == len(chain), f"the chain must not repeat a token: {chain}"
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    embed = tensors["model.embed_tokens.weight"]
    head = torch.zeros_like(tensors["lm_head.weight"])
    for prev, nxt in itertools.pairwise(chain):
        head[nxt] = 50 * embed[prev] / embed[prev].norm()
    tensors["lm_head.weight"] = head
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("kvfleet_tokenizer")
    (out / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_id]}))
    return chain


@pytest.fixture(params=["bpe", "spm"], scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, list[int], HFTokenizer]]:
    tokenizer_dir = Path(request.getfixturevalue(f"{request.param}_dir"))
    stop = load_tokenizer(tokenizer_dir)
    assert isinstance(stop, HFTokenizer) and stop.eos_token is not None
    stop_id = stop.encode(stop.eos_token, bos=False)[0]
    out = tmp_path_factory.mktemp(f"served-{request.param}") / "m"
    chain = _chain_checkpoint(out, tokenizer_dir, stop_id)
    config_path = out.parent / "replica.yaml"
    config_path.write_text(yaml.safe_dump({**TEST_CONFIG, "model_id": "m"}))
    overrides = {"model_dir": str(out)}
    replica = build_replica(load_config(config_path, environ={}, overrides=overrides),
                            overrides=overrides)
    assert isinstance(replica.tokenizer, HFTokenizer)
    with ServerThread(replica) as server:
        yield f"http://127.0.0.1:{server.port}/v1", chain, replica.tokenizer


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                         default_headers={"X-Kvfleet-Tenant": "default"})


def test_text_prompt_encoded_with_the_models_tokenizer_and_stops_on_its_eos(
        served: tuple[str, list[int], HFTokenizer]) -> None:
    base_url, chain, tok = served
    out = _client(base_url).completions.create(model="m", prompt=PROMPT, max_tokens=20,
                                               temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == chain[1:]
    assert choice.text == ANSWER
    assert out.usage is not None and out.usage.prompt_tokens == len(tok.encode(PROMPT))


def test_streamed_text_is_whole_characters_and_equals_the_completion(
        served: tuple[str, list[int], HFTokenizer]) -> None:
    base_url, chain, _ = served
    chunks = list(_client(base_url).completions.create(model="m", prompt=PROMPT, max_tokens=20,
                                                       temperature=0, stream=True))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == ANSWER
    assert all("\ufffd" not in t for t in texts)
    # The emoji is several tokens: the chunks of its first bytes carry no text.
    assert "" in texts and "🙂" in texts[: len(chain)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


def test_max_tokens_cuts_a_character_and_the_text_says_so(
        served: tuple[str, list[int], HFTokenizer]) -> None:
    base_url, chain, tok = served
    out = _client(base_url).completions.create(model="m", prompt=PROMPT, max_tokens=2,
                                               temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text == tok.decode(chain[1:3])


def _replica_config(tmp_path: Path, model: Path) -> tuple[Path, dict[str, str]]:
    config_path = tmp_path / "replica.yaml"
    config_path.write_text(yaml.safe_dump({**TEST_CONFIG, "model_id": "m"}))
    return config_path, {"model_dir": str(model)}


def test_a_folder_without_a_tokenizer_is_refused_at_start(tmp_path: Path) -> None:
    model = tmp_path / "m"
    generate_checkpoint(model, ModelArgs.from_preset("tiny"), seed=0)
    config = json.loads((model / "config.json").read_text())
    config.pop("kvfleet_tokenizer")
    (model / "config.json").write_text(json.dumps(config))
    config_path, overrides = _replica_config(tmp_path, model)
    with pytest.raises(ValueError, match=r"has no tokenizer: no tokenizer\.json"):
        build_replica(load_config(config_path, environ={}, overrides=overrides),
                      overrides=overrides)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(
        tmp_path: Path, bpe_dir: Path) -> None:  # noqa: F811
    model = tmp_path / "m"
    generate_checkpoint(model, ModelArgs.from_preset("tiny"), seed=0)
    config = json.loads((model / "config.json").read_text())
    config.pop("kvfleet_tokenizer")
    (model / "config.json").write_text(json.dumps(config))
    for f in bpe_dir.iterdir():
        shutil.copy(f, model / f.name)
    config_path, overrides = _replica_config(tmp_path, model)
    size = load_tokenizer(bpe_dir).vocab_size
    with pytest.raises(ValueError, match=f"the tokenizer has {size} ids but the model's "
                                         r"vocabulary has 259 \(vocab_size in config.json\)"):
        build_replica(load_config(config_path, environ={}, overrides=overrides),
                      overrides=overrides)


def test_text_that_is_not_unicode_is_a_400(served: tuple[str, list[int], HFTokenizer]) -> None:
    base_url, _, _ = served
    # JSON may spell a lone surrogate (the openai client cannot send one).
    body = b'{"model": "m", "prompt": "a\\ud800b", "max_tokens": 2}'
    request = urllib.request.Request(base_url + "/completions", data=body, headers={
        "Content-Type": "application/json", "X-Kvfleet-Tenant": "default"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400
    assert "error" in json.loads(err.value.read())
