"""tests/vllm run in vLLM's own environment (`make test-vllm`; vllm pins its own torch), with the
repository on PYTHONPATH. The main environment has no vllm: every module here starts with
`pytest.importorskip("vllm")`, so the main run skips them with that reason."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-layer Llama checkpoint in float16, written by transformers (4 KV heads of 16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(path)
    return path
