"""Test helpers that several test packages share: loopback ports, /metrics counters, a settable
clock, the tiny checkpoint and the Llama checkpoint `vllm serve` loads. Imports only the standard
library and pytest at module level, because tests/vllm and tests/vllm_serve import it from vLLM's
own environments."""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port on `host` (loopback; "0.0.0.0": free on every address, so no wildcard listener
    of another test holds it) never handed out before in this session: the kernel may give the
    same ephemeral port to two calls in a row, and two replicas told one port make the second fail
    to bind while its readiness probe reaches the first. The tests' one port picker."""
    for _ in range(64):
        with contextlib.closing(socket.socket()) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no fresh loopback port in 64 tries")


MATCHED = "kvfleet_cache_matched_tokens_total"
"""Prompt tokens kvfleet's cache matched (a kvfleet replica's, or the connector's on vLLM's
/metrics: tokens loaded beyond vLLM's own prefix hit)."""
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
"""vLLM's prompt tokens by where they came from (`source`: local_cache_hit, external_kv_transfer,
local_compute)."""


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text exposition as {`name{labels}` as written: value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def counter(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples (in `parse_metrics`' form) whose labels include `labels`."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


@dataclass
class FakeClock:
    """A clock the test sets: pass it where the code takes a `clock` callable."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The "tiny" preset's checkpoint (seed 0), written once per session and only read after."""
    from kvfleet_runtime.model import ModelArgs, generate_checkpoint

    out = tmp_path_factory.mktemp("tiny")
    generate_checkpoint(out, ModelArgs.from_preset("tiny"), seed=0)
    return out


def write_serve_llama(out: Path, seed: int = 0) -> Path:
    """A real 2-layer Llama in float16 written by transformers into `out`, with its own byte-level
    BPE tokenizer (trained here, no downloads): what `vllm serve` loads in tests/vllm_serve and in
    the e2e's vLLM pods. head_dim 64: vLLM's CPU attention refuses 16. 1 KiB of KV per token (2
    layers x 2 KV heads x 64 x K and V x 2 bytes). `seed` draws the weights; the tokenizer is the
    same for every seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.runtime.tokenizer.conftest import (
        LLAMA3_TEMPLATE,
        byte_level_bpe,
        save_with_transformers,
    )

    tok = byte_level_bpe()
    save_with_transformers(tok, out, chat_template=LLAMA3_TEMPLATE,
                           bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    config = LlamaConfig(vocab_size=640, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=2048,
                         bos_token_id=tok.token_to_id("<|begin_of_text|>"),
                         eos_token_id=tok.token_to_id("<|eot_id|>"))
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(out)
    return out
