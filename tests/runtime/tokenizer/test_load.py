"""`load_tokenizer`: which tokenizer a folder gets, and every refusal with its message."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvfleet_runtime.tokenizer import (
    BYTE_TOKENIZER_NAME,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
)
from tests.runtime.tokenizer.conftest import STRINGS, byte_fallback_bpe, byte_level_bpe

transformers = pytest.importorskip("transformers")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def test_the_generated_demo_model_declares_the_byte_tokenizer(tmp_path: Path) -> None:
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint

    generate_checkpoint(tmp_path, ModelArgs.from_preset("tiny"), seed=0)
    assert json.loads((tmp_path / "config.json").read_text())["kvfleet_tokenizer"] == "byte-v1"
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.name == BYTE_TOKENIZER_NAME


@pytest.mark.parametrize("cls_name", ["Qwen2Tokenizer", "LlamaTokenizer", "GPT2Tokenizer"])
def test_folders_written_by_model_specific_classes_equal_transformers(
        tmp_path: Path, cls_name: str) -> None:
    """transformers 5 builds these classes' pipelines itself; a folder their save_pretrained
    wrote (as real checkpoints are) holds that pipeline in tokenizer.json, so ids agree."""
    backend = byte_fallback_bpe() if cls_name == "LlamaTokenizer" else byte_level_bpe()
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    getattr(transformers, cls_name)(vocab=model["vocab"], merges=merges).save_pretrained(
        str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, HFTokenizer)
    for text in STRINGS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text),
                                                           skip_special_tokens=True)


def test_no_tokenizer_and_no_declaration_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"has no tokenizer: no tokenizer.json, and config.json "
                                         r"does not declare kvfleet_tokenizer='byte-v1'"):
        load_tokenizer(tmp_path)


def test_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer folder .*nope does not exist"):
        load_tokenizer(tmp_path / "nope")


@pytest.mark.parametrize("files", [["tokenizer.model"], ["vocab.json", "merges.txt"]])
def test_slow_tokenizer_files_without_tokenizer_json_are_refused(tmp_path: Path,
                                                                 files: list[str]) -> None:
    for name in files:
        (tmp_path / name).write_text("x")
    with pytest.raises(ValueError, match=f"has {', '.join(files)} but no tokenizer.json; "
                                         "kvfleet loads the fast tokenizer file only"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_json_never_falls_back_to_bytes(tmp_path: Path, bpe_dir: Path) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    _edit_json(folder / "config.json", kvfleet_tokenizer="byte-v1")
    with pytest.raises(ValueError, match=re.escape(
            "has a tokenizer.json and config.json declares kvfleet_tokenizer='byte-v1': one "
            "tokenizer only")):
        load_tokenizer(folder)


def test_an_unknown_declared_tokenizer_is_refused(tmp_path: Path) -> None:
    _edit_json(tmp_path / "config.json", kvfleet_tokenizer="byte-v9")
    with pytest.raises(ValueError, match="declares kvfleet_tokenizer='byte-v9'; the only "
                                         "declared tokenizer is 'byte-v1'"):
        load_tokenizer(tmp_path)


def test_custom_tokenizer_code_is_refused(tmp_path: Path, bpe_dir: Path) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    _edit_json(folder / "tokenizer_config.json",
               auto_map={"AutoTokenizer": ["tok.MyTokenizer", None]})
    with pytest.raises(ValueError, match=r"names custom tokenizer code \(auto_map .*MyTokenizer"
                                         r".*never runs a checkpoint's code"):
        load_tokenizer(folder)


def test_a_malformed_tokenizer_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a tokenizers file"):
        load_tokenizer(tmp_path)


def test_a_special_token_the_vocabulary_lacks_is_refused(tmp_path: Path, bpe_dir: Path) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    _edit_json(folder / "tokenizer_config.json", pad_token="<|pad|>")
    with pytest.raises(ValueError, match=re.escape("names pad_token '<|pad|>', which "
                                                   "tokenizer.json does not have")):
        load_tokenizer(folder)


def test_bos_flag_contradicting_the_post_processor_is_refused(tmp_path: Path,
                                                              bpe_dir: Path) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    _edit_json(folder / "tokenizer_config.json", add_bos_token=False)
    with pytest.raises(ValueError, match=re.escape(
            "sets add_bos_token=False, but the post-processor of tokenizer.json adds "
            "'<|begin_of_text|>'")):
        load_tokenizer(folder)
    _edit_json(folder / "tokenizer_config.json", add_bos_token=True)
    assert load_tokenizer(folder).encode("x")[0] == 0


@pytest.mark.parametrize("value", [[], [99999], "2", [1, "4"]])
def test_bad_eos_token_ids_are_refused(tmp_path: Path, bpe_dir: Path, value: object) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    _edit_json(folder / "generation_config.json", eos_token_id=value)
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id .* must be a "
                                         r"token id or a non-empty list of token ids below the "
                                         r"vocabulary size \d+"):
        load_tokenizer(folder)


def test_named_templates_without_a_default_are_refused(tmp_path: Path, bpe_dir: Path) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    (folder / "chat_template.jinja").unlink()
    _edit_json(folder / "tokenizer_config.json",
               chat_template=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(ValueError, match=r"names templates \['tool_use'\] but none is 'default'"):
        load_tokenizer(folder)


def test_a_template_that_does_not_parse_is_refused(tmp_path: Path, bpe_dir: Path) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="the chat template does not parse"):
        load_tokenizer(folder)


def test_no_chat_template_refuses_chat_only(tmp_path: Path, bpe_dir: Path) -> None:
    folder = _copy(bpe_dir, tmp_path / "m")
    (folder / "chat_template.jinja").unlink()
    tok = load_tokenizer(folder)
    assert tok.encode("hi")
    with pytest.raises(ValueError, match="has no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
