"""The router tokenizes text prompts with the replicas' own tokenizer, or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvfleet_runtime.affinity import rendezvous_top_k
from kvfleet_runtime.cache import CacheKey, block_hashes
from kvfleet_runtime.cli import app
from kvfleet_runtime.fleet import EmbeddedHintIndex
from kvfleet_runtime.picker import PickRequest, chat_token_ids, prompt_token_ids
from kvfleet_runtime.tokenizer import ByteTokenizer, load_tokenizer
from tests.router.conftest import KEY_FIELDS, FakeReplica, StartRouter
from tests.runtime.tokenizer.conftest import bpe_dir, spm_dir  # noqa: F401 (fixtures)

pytest.importorskip("transformers")

NAMES = [f"r{i}" for i in range(5)]
PROMPT = "You are a helpful assistant 🙂. Answer in Chinese: 你好. " * 4


def test_the_routers_tokenizer_is_used_only_under_the_replicas_name(
        bpe_dir: Path, spm_dir: Path) -> None:  # noqa: F811
    bpe, spm = load_tokenizer(bpe_dir), load_tokenizer(spm_dir)
    assert prompt_token_ids(PROMPT, bpe.name, bpe) == bpe.encode(PROMPT)
    assert prompt_token_ids(PROMPT, spm.name, bpe) is None
    assert prompt_token_ids(PROMPT, bpe.name, None) is None
    assert prompt_token_ids(PROMPT, "", bpe) is None
    # The byte tokenizer needs no files; a loaded one does not stand in for it.
    assert prompt_token_ids(PROMPT, "byte-v1", bpe) == ByteTokenizer().encode(PROMPT)
    assert prompt_token_ids([5, 6], spm.name, bpe) == [5, 6]


async def test_cache_aware_override_with_the_models_tokenizer(
        bpe_dir: Path, spm_dir: Path, replicas: list[FakeReplica],  # noqa: F811
        start_router: StartRouter) -> None:
    tok = load_tokenizer(bpe_dir)
    for r in replicas:
        r.load["tokenizer"] = tok.name
    index = EmbeddedHintIndex()
    router = await start_router(replicas, index=index, recompute_s_per_token=1e-3)
    warm = next(n for n in NAMES if n not in rendezvous_top_k("acme", NAMES, 3))
    await index.publish(warm, block_hashes(CacheKey("acme", **KEY_FIELDS), tok.encode(PROMPT)))
    # Without the tokenizer the router cannot know the ids: it routes home, never guesses.
    _, headers, body = await router.post({"prompt": PROMPT})
    assert headers["X-Kvfleet-Route"] == "home"
    router.state.picker.tokenizer = load_tokenizer(spm_dir)
    _, headers, body = await router.post({"prompt": PROMPT})
    assert headers["X-Kvfleet-Route"] == "home"
    router.state.picker.tokenizer = tok
    _, headers, body = await router.post({"prompt": PROMPT})
    assert body["replica"] == warm and headers["X-Kvfleet-Route"] == "warm"
    # A long document is tokenized off the event loop, to the same ids.
    long = "A long document 📄 with CJK 文書. " * 200
    assert len(long) > 4096
    warm_g = next(n for n in NAMES if n not in rendezvous_top_k("globex", NAMES, 3))
    await index.publish(warm_g, block_hashes(CacheKey("globex", **KEY_FIELDS), tok.encode(long)))
    _, headers, body = await router.post({"prompt": long}, key="sk-globex")
    assert body["replica"] == warm_g and headers["X-Kvfleet-Route"] == "warm"


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text("tenants:\n  acme: [sk-acme]\n")
    return path


def test_router_cli_refuses_a_folder_without_a_tokenizer(keys: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["router", "--keys", str(keys), "--replica",
                                      "r0=http://a:1", "--tokenizer", str(tmp_path)])
    assert result.exit_code == 2
    assert "--tokenizer:" in result.output and "has no tokenizer" in result.output
    assert "Traceback" not in result.output


def test_chat_ids_are_the_replicas_template_or_none(bpe_dir: Path) -> None:  # noqa: F811
    tok = load_tokenizer(bpe_dir)
    messages = [{"role": "user", "content": "hi 🙂"}]
    assert chat_token_ids(messages, tok.name, tok) == tok.encode_chat(messages)
    assert chat_token_ids(messages, "hf-sha256:other", tok) is None
    assert chat_token_ids("not a list", tok.name, tok) is None
    assert chat_token_ids([], tok.name, tok) is None  # the replica says why
    assert chat_token_ids(messages, "byte-v1") == ByteTokenizer().encode_chat(messages)


def test_text_that_is_not_unicode_is_not_tokenized(bpe_dir: Path) -> None:  # noqa: F811
    tok = load_tokenizer(bpe_dir)
    assert prompt_token_ids("a\ud800b", tok.name, tok) is None
    assert prompt_token_ids("a\ud800b", "byte-v1") is None
    with pytest.raises(ValueError, match="not valid Unicode"):
        tok.encode("a\ud800b")


def chat(tenant: str, messages: list[dict[str, str]]) -> PickRequest:
    return PickRequest(tenant, {"messages": messages}, chat=True)


async def test_chat_messages_are_matched_under_the_replicas_template(
        bpe_dir: Path, replicas: list[FakeReplica], start_router: StartRouter) -> None:  # noqa: F811
    tok = load_tokenizer(bpe_dir)
    for r in replicas:
        r.load["tokenizer"] = tok.name
    index = EmbeddedHintIndex()
    router = await start_router(replicas, index=index, recompute_s_per_token=1e-3)
    router.state.picker.tokenizer = tok
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hi"}]
    ids = tok.encode_chat(messages)
    await index.publish("r1", block_hashes(CacheKey("acme", **KEY_FIELDS), ids))
    matched = await router.state.picker.matched_tokens(chat("acme", messages))
    assert matched == {"r1": len(ids) // 16 * 16}
    long = [{"role": "user", "content": PROMPT * 30}]
    assert len(PROMPT * 30) > 4096
    await index.publish("r2", block_hashes(CacheKey("acme", **KEY_FIELDS), tok.encode_chat(long)))
    assert (await router.state.picker.matched_tokens(chat("acme", long))).get("r2", 0) > 4096
    router.state.picker.tokenizer = None
    assert await router.state.picker.matched_tokens(chat("acme", messages)) == {}
