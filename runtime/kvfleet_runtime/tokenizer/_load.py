"""`load_tokenizer(model_dir)`: the tokenizer a model folder declares, or a clear refusal.

- `tokenizer.json` present: the Hugging Face tokenizer (`HFTokenizer`), read the way transformers
  5 reads it: the file's own pipeline (its post-processor decides BOS/EOS: transformers 5 drops
  `add_bos_token` / `add_eos_token` from tokenizer_config.json when tokenizer.json exists, so a
  config whose flags contradict the file is refused rather than guessed), the named special tokens
  from tokenizer_config.json (then special_tokens_map.json), the chat template from
  `chat_template.jinja` (+ `additional_chat_templates/*.jinja`), else tokenizer_config.json's
  `chat_template` (a string or a list of named templates), else `chat_template.json`.
- no tokenizer.json, config.json declares `"kvfleet_tokenizer": "byte-v1"`: the byte tokenizer
  (the generated demo model).
- anything else is refused: other tokenizer files without tokenizer.json (a sentencepiece
  `tokenizer.model`, `vocab.json` + `merges.txt`), custom tokenizer code (`auto_map`: kvfleet never
  runs a checkpoint's code), no tokenizer at all.

Stop ids: `eos_token_id` of generation_config.json, else of config.json (an int or a list), else
the tokenizer's `eos_token`. The name is "hf-sha256:" + SHA-256 over the tokenizer files (name,
length, bytes, in a fixed order): the router compares it with the replicas' to know it encodes
exactly as they do.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Backend

from kvfleet_runtime.tokenizer._byte import BYTE_TOKENIZER_NAME, ByteTokenizer
from kvfleet_runtime.tokenizer._hf import HFTokenizer
from kvfleet_runtime.tokenizer._protocol import Tokenizer

__all__ = [
    "BYTE_TOKENIZER_DECLARATION",
    "TOKENIZER_JSON",
    "load_tokenizer",
    "tokenizer_files_digest",
]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"
BYTE_TOKENIZER_DECLARATION = "kvfleet_tokenizer"
"""The config.json key by which a checkpoint declares the byte tokenizer (value "byte-v1")."""

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
_OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                          "tekken.json", "tiktoken.model")


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The folder's tokenizer; ValueError naming the folder and the problem otherwise."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"tokenizer folder {model_dir} does not exist")
    config = _read_json(model_dir / MODEL_CONFIG)
    declared = config.get(BYTE_TOKENIZER_DECLARATION)
    if (model_dir / TOKENIZER_JSON).is_file():
        if declared is not None:
            raise ValueError(f"{model_dir} has a {TOKENIZER_JSON} and config.json declares "
                             f"{BYTE_TOKENIZER_DECLARATION}={declared!r}: one tokenizer only; "
                             f"remove the declaration to serve the tokenizer.json")
        return _load_hf(model_dir, config)
    if declared is not None:
        if declared != BYTE_TOKENIZER_NAME:
            raise ValueError(f"{model_dir}/config.json declares {BYTE_TOKENIZER_DECLARATION}="
                             f"{declared!r}; the only declared tokenizer is "
                             f"{BYTE_TOKENIZER_NAME!r}")
        return ByteTokenizer()
    others = [f for f in _OTHER_TOKENIZER_FILES if (model_dir / f).is_file()]
    if others:
        raise ValueError(f"{model_dir} has {', '.join(others)} but no {TOKENIZER_JSON}; kvfleet "
                         "loads the fast tokenizer file only. Write it with transformers: "
                         "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    raise ValueError(f"{model_dir} has no tokenizer: no {TOKENIZER_JSON}, and config.json does "
                     f"not declare {BYTE_TOKENIZER_DECLARATION}={BYTE_TOKENIZER_NAME!r} (the "
                     "generated demo model's byte tokenizer)")


def tokenizer_files_digest(model_dir: Path) -> str:
    """SHA-256 over every file that changes how text becomes ids (or ids text)."""
    h = hashlib.sha256()
    for path in _tokenizer_files(Path(model_dir)):
        data = path.read_bytes()
        h.update(f"{path.relative_to(model_dir).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return "hf-sha256:" + h.hexdigest()


def _tokenizer_files(model_dir: Path) -> list[Path]:
    files = [model_dir / f for f in (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP,
                                     CHAT_TEMPLATE_JINJA, CHAT_TEMPLATE_JSON)]
    files += sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja"))
    return [f for f in files if f.is_file()]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _load_hf(model_dir: Path, config: Mapping[str, Any]) -> HFTokenizer:
    tok_config = _read_json(model_dir / TOKENIZER_CONFIG)
    auto_map = tok_config.get("auto_map")
    if auto_map:
        raise ValueError(f"{model_dir}/{TOKENIZER_CONFIG} names custom tokenizer code (auto_map "
                         f"{auto_map!r}); kvfleet never runs a checkpoint's code "
                         "(trust_remote_code)")
    try:
        backend = _Backend.from_file(str(model_dir / TOKENIZER_JSON))
    except Exception as exc:  # the library raises a bare Exception on a malformed file
        raise ValueError(f"{model_dir}/{TOKENIZER_JSON} is not a tokenizers file: {exc}") from exc
    special = _special_tokens(model_dir, tok_config)
    for key, content in special.items():
        if backend.token_to_id(content) is None:
            # transformers would append it as a new id the model never saw.
            raise ValueError(f"{model_dir}/{TOKENIZER_CONFIG} names {key} {content!r}, which "
                             f"{TOKENIZER_JSON} does not have")
    _check_bos_eos_flags(model_dir, tok_config, backend, special)
    if tok_config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        raise ValueError(f"{model_dir}/{TOKENIZER_CONFIG} sets clean_up_tokenization_spaces for a "
                         f"{type(backend.model).__name__} tokenizer; that decode rewrite is not "
                         "supported (transformers applies it; streaming could not)")
    return HFTokenizer(backend, name=tokenizer_files_digest(model_dir),
                       stop_ids=_stop_ids(model_dir, config, backend, special),
                       special_tokens=special,
                       chat_templates=_chat_templates(model_dir, tok_config))


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(model_dir: Path, tok_config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens a chat template sees: the standard seven, then, as transformers
    5 does, any other `*_token` string (and `extra_special_tokens` given as a name -> token map)."""
    legacy = _read_json(model_dir / SPECIAL_TOKENS_MAP)
    extra = tok_config.get("extra_special_tokens")
    named = {**legacy, **tok_config, **(extra if isinstance(extra, Mapping) else {})}
    keys = [*_SPECIAL_TOKEN_KEYS,
            *sorted(k for k, v in named.items() if k.endswith("_token") and
                    k not in _SPECIAL_TOKEN_KEYS and _token_content(v) is not None)]
    out: dict[str, str] = {}
    for key in keys:
        value = named.get(key)
        content = _token_content(value)
        if value is not None and content is None:
            raise ValueError(f"{model_dir}/{TOKENIZER_CONFIG}: {key} {value!r} is neither a string "
                             "nor a token object with a content string")
        if content is not None:
            out[key] = content
    return out


def _check_bos_eos_flags(model_dir: Path, tok_config: Mapping[str, Any], backend: _Backend,
                         special: Mapping[str, str]) -> None:
    probe = backend.encode("a", add_special_tokens=True).ids
    for flag, key, at in (("add_bos_token", "bos_token", 0), ("add_eos_token", "eos_token", -1)):
        if flag not in tok_config or key not in special:
            continue
        token_id = backend.token_to_id(special[key])
        adds = bool(probe) and probe[at] == token_id
        if bool(tok_config[flag]) != adds:
            raise ValueError(
                f"{model_dir}/{TOKENIZER_CONFIG} sets {flag}={tok_config[flag]!r}, but the "
                f"post-processor of {TOKENIZER_JSON} {'adds' if adds else 'does not add'} "
                f"{special[key]!r}; transformers 4 and 5 disagree on such a folder, so it is "
                "refused: make the two agree")


def _stop_ids(model_dir: Path, config: Mapping[str, Any], backend: _Backend,
              special: Mapping[str, str]) -> frozenset[int]:
    vocab = backend.get_vocab_size(with_added_tokens=True)
    for source, data in ((GENERATION_CONFIG, _read_json(model_dir / GENERATION_CONFIG)),
                         (MODEL_CONFIG, config)):
        raw = data.get("eos_token_id")
        if raw is None:
            continue
        ids = raw if isinstance(raw, list) else [raw]
        if not ids or not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise ValueError(f"{model_dir}/{source}: eos_token_id {raw!r} must be a token id or "
                             f"a non-empty list of token ids below the vocabulary size {vocab}")
        return frozenset(ids)
    eos = special.get("eos_token")
    eos_id = backend.token_to_id(eos) if eos is not None else None
    return frozenset() if eos_id is None else frozenset({eos_id})


def _chat_templates(model_dir: Path, tok_config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    jinja = model_dir / CHAT_TEMPLATE_JINJA
    if jinja.is_file():
        templates["default"] = jinja.read_text(encoding="utf-8")
    for extra in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        templates[extra.name.removesuffix(".jinja")] = extra.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = tok_config.get("chat_template")
    where = f"{model_dir}/{TOKENIZER_CONFIG}: chat_template"
    if raw is None:
        raw = _read_json(model_dir / CHAT_TEMPLATE_JSON).get("chat_template")
        where = f"{model_dir}/{CHAT_TEMPLATE_JSON}: chat_template"
    if raw is None:
        return {}
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                     and isinstance(t.get("template"), str) for t in raw):
        named = {str(t["name"]): str(t["template"]) for t in raw}
        if "default" not in named:
            raise ValueError(f"{where} names templates {sorted(named)} but none is 'default'")
        return named
    raise ValueError(f"{where} must be a string or a list of {{name, template}}, got "
                     f"{type(raw).__name__}")
