"""Tiny real tokenizers, trained here with `tokenizers` and saved by transformers (no downloads):

- `bpe_dir`: byte-level BPE with Llama-3's special tokens, BOS added by the post-processor and
  a Llama-3-style chat template;
- `spm_dir`: a sentencepiece-style BPE (Metaspace, byte fallback for characters outside its
  vocabulary: emoji, most CJK) with Llama-2's `<s>`/`</s>` and a ChatML (Qwen-style) template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! Hello there, how are you today? I'm fine, thanks.",
    "def main():\n    return 42\n\n\tindented with a tab",
    "Prefix caches keep the KV of system prompts, documents and agent transcripts.",
    "café naïve résumé über straße",
    "你好世界，中文。",
    "numbers 0123456789 and symbols !@#$%^&*()[]{}<>",
] * 20

STRINGS = [
    "Hello world",
    "",
    " leading space",
    "trailing space ",
    "whitespace   runs\n\n\n\tand\ttabs    end",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "CJK 你好，世界 日本語のテキスト 한국어",
    "mixed ünïcödé café naïve",
    "special tokens in text: <|eot_id|> <s></s> <|im_end|> <|begin_of_text|>",
    "The quick brown fox jumps over the lazy dog.",
    "a" * 70,
    "😀" * 5 + "z",
]

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

CHATML_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}{{ message.content }}
    {%- else %}{{ message.content | tojson }}{% endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Llama-3 / GPT-4 style: a regex split, then byte-level without its own regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def byte_fallback_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=CHATML_SPECIALS,
                                  limit_alphabet=80, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Sentencepiece's byte fallback: <0x00>..<0xFF> are ordinary vocabulary entries.
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab) + len(CHATML_SPECIALS))
    vocab_ids = sorted(set(vocab.values()))
    assert len(vocab_ids) == len(vocab)
    data["model"]["byte_fallback"] = True
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = Tokenizer.from_str(json.dumps(data))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return tok


def save_with_transformers(tok: Tokenizer, out: Path, *, chat_template: str | None,
                           **special: str) -> Path:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, **special)
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    save_with_transformers(byte_level_bpe(), out, chat_template=LLAMA3_TEMPLATE,
                           bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": [1, 4]}))
    return out


@pytest.fixture(scope="session")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("spm")
    save_with_transformers(byte_fallback_bpe(), out, chat_template=CHATML_TEMPLATE,
                           bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    (out / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return out
