"""The model's own tokenizer against transformers (the oracle): same folder, same ids, same text,
same chat ids; streamed text equals the whole decode, split multi-byte characters included."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from kvfleet_runtime.tokenizer import HFTokenizer, load_tokenizer
from tests.runtime.tokenizer.conftest import CHATML_TEMPLATE, STRINGS

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "Hello 🙂"}],
    [{"role": "system", "content": "Answer in Chinese."},
     {"role": "user", "content": "你好，世界"},
     {"role": "assistant", "content": "  trimmed?  "},
     {"role": "user", "content": "again <|eot_id|> <|im_end|>"}],
    [{"role": "user", "content": "whitespace   runs\n\n\tand tabs"},
     {"role": "assistant", "content": "ok", "name": None, "reasoning_content": "thinking"},
     {"role": "user", "content": "emoji 👨‍👩‍👧 flag 🇫🇷"}],
]


def _hf(folder: Path):  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _ours(folder: Path) -> HFTokenizer:
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(params=["bpe", "spm"])
def folder(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(f"{request.param}_dir"))


@pytest.mark.parametrize("text", STRINGS)
def test_ids_and_text_equal_transformers(folder: Path, text: str) -> None:
    hf, ours = _hf(folder), _ours(folder)
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.encode(text, bos=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", STRINGS)
def test_streamed_text_is_the_whole_decode(folder: Path, text: str) -> None:
    ours = _ours(folder)
    ids = ours.encode(text, bos=False)
    decoder = ours.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == ours.decode(ids)
    # No piece is half a character: a split character is held back until it is whole.
    assert all("\ufffd" not in p for p in pieces)


def test_multi_token_characters_are_held_back(spm_dir: Path, bpe_dir: Path) -> None:
    for folder in (spm_dir, bpe_dir):
        ours = _ours(folder)
        ids = ours.encode("🙂", bos=False)
        assert len(ids) > 1, "the test needs an emoji that is not one token"
        decoder = ours.stream_decoder()
        pieces = [decoder.push(i) for i in ids]
        assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1].endswith("🙂")
        assert decoder.flush() == ""


def test_a_stream_cut_mid_character_flushes_what_the_decode_gives(spm_dir: Path) -> None:
    ours = _ours(spm_dir)
    ids = ours.encode("ok 🙂", bos=False)[:-1]
    decoder = ours.stream_decoder()
    text = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert text == ours.decode(ids) and text.endswith("\ufffd")


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_ids_equal_apply_chat_template(folder: Path, chat: int,
                                            generation_prompt: bool) -> None:
    hf, ours = _hf(folder), _ours(folder)
    messages = CHATS[chat]
    expected = hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                      add_generation_prompt=generation_prompt)
    assert ours.encode_chat(messages, add_generation_prompt=generation_prompt) == expected
    text = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt=generation_prompt) == text


def test_template_in_tokenizer_config_and_named_templates(tmp_path: Path, spm_dir: Path) -> None:
    """transformers 4 wrote the template into tokenizer_config.json (a string, or a list of
    named templates); both are read, and chat_template.jinja wins over them."""
    for value in (CHATML_TEMPLATE, [{"name": "default", "template": CHATML_TEMPLATE},
                                    {"name": "tool_use", "template": "{{ 'tools' }}"}]):
        folder = tmp_path / f"v{len(str(value))}"
        shutil.copytree(spm_dir, folder)
        (folder / "chat_template.jinja").unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                  "chat_template": value}))
        expected = _hf(folder).apply_chat_template(CHATS[1], tokenize=True, return_dict=False,
                                                   add_generation_prompt=True)
        assert _ours(folder).encode_chat(CHATS[1]) == expected
    folder = tmp_path / "both"
    shutil.copytree(spm_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": "{{ 'old' }}"}))
    expected = _hf(folder).apply_chat_template(CHATS[0], tokenize=False)
    assert _ours(folder).render_chat(CHATS[0], add_generation_prompt=False) == expected
    assert "old" not in expected


def test_template_refusals_are_value_errors_naming_the_reason(spm_dir: Path) -> None:
    ours = _ours(spm_dir)
    with pytest.raises(ValueError, match="unknown role narrator"):
        ours.encode_chat([{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="messages is empty"):
        ours.encode_chat([])
    with pytest.raises(ValueError, match=r"messages\[0\].content is a bytes"):
        ours.encode_chat([{"role": "user", "content": b"x"}])


def test_template_sandbox_refuses_python_internals(tmp_path: Path, spm_dir: Path) -> None:
    folder = tmp_path / "evil"
    shutil.copytree(spm_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template refused"):
        _ours(folder).encode_chat(CHATS[0])


def test_stop_ids_from_generation_config_list_then_config_then_eos_token(
        tmp_path: Path, bpe_dir: Path, spm_dir: Path) -> None:
    # bpe_dir: generation_config.json says [1, 4]; spm_dir: config.json says 2.
    assert _ours(bpe_dir).stop_ids == frozenset({1, 4})
    assert _ours(spm_dir).stop_ids == frozenset({2})
    folder = tmp_path / "no-configs"
    shutil.copytree(bpe_dir, folder)
    (folder / "generation_config.json").unlink()
    eot = _hf(folder).convert_tokens_to_ids("<|eot_id|>")
    assert _ours(folder).stop_ids == frozenset({eot})


def test_bos_comes_from_the_post_processor(bpe_dir: Path) -> None:
    ours = _ours(bpe_dir)
    bos = _hf(bpe_dir).bos_token_id
    assert ours.encode("hi")[0] == bos and ours.encode("hi", bos=False)[0] != bos


def test_name_is_a_digest_of_the_tokenizer_files(tmp_path: Path, bpe_dir: Path) -> None:
    a = _ours(bpe_dir).name
    copy = tmp_path / "copy"
    shutil.copytree(bpe_dir, copy)
    assert _ours(copy).name == a and a.startswith("hf-sha256:")
    (copy / "chat_template.jinja").write_text("{{ 'other' }}")
    assert _ours(copy).name != a


def test_loading_imports_no_torch(bpe_dir: Path) -> None:
    import subprocess

    code = (f"import sys; from kvfleet_runtime.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(bpe_dir)!r}).encode('x'); "
            f"sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_model_specific_tokens_reach_the_template(tmp_path: Path, bpe_dir: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(bpe_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "eot_token": "<|eot_id|>"}))
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eot_token }}{% endfor %}")
    expected = _hf(folder).apply_chat_template(CHATS[2], tokenize=False)
    assert _ours(folder).render_chat(CHATS[2], add_generation_prompt=False) == expected
    assert expected.count("<|eot_id|>") == len(CHATS[2])


@pytest.mark.parametrize("text", STRINGS)
def test_token_bytes_are_the_texts_bytes(bpe_dir: Path, spm_dir: Path, text: str) -> None:
    """Token by token, the raw bytes add up to the text (split characters included); the
    sentencepiece-style tokenizer's own leading space (its normalizer prepends one to every
    stretch of text between special tokens) is a byte too, which the decoder strips."""
    bpe, spm = _ours(bpe_dir), _ours(spm_dir)
    assert b"".join(bpe.token_bytes(i) for i in bpe.encode(text, bos=False)) == text.encode()
    if "<s>" in text:
        return
    spm_bytes = b"".join(spm.token_bytes(i) for i in spm.encode(text, bos=False))
    assert spm_bytes == (b" " + text.encode() if text else b"")


def test_token_bytes_of_a_split_emoji_are_its_utf8_bytes(bpe_dir: Path, spm_dir: Path) -> None:
    for folder in (bpe_dir, spm_dir):
        tok = _ours(folder)
        pieces = [tok.token_bytes(i) for i in tok.encode("🙂", bos=False)]
        assert b"".join(pieces).endswith("🙂".encode()) and len(pieces) > 1
    bpe = _ours(bpe_dir)
    assert bpe.token_bytes(bpe.encode("x")[0]) == b"<|begin_of_text|>"
    assert bpe.token_bytes(10**6) == b""
