"""Reference model: paged prefill/decode vs a dense reference, chunk invariance, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvfleet_runtime.model import (
    ModelArgs,
    PackedLinear,
    PagedKV,
    Transformer,
    generate_checkpoint,
    load_checkpoint,
    onednn_packing_supported,
    weights_digest,
)
from kvfleet_runtime.model.model import apply_rope
from kvfleet_runtime.tokenizer import ByteTokenizer
from kvfleet_runtime.wire import BLOCK_SIZE


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Transformer:
    return load_checkpoint(tiny_dir, device=torch.device("cpu")).model


def dense_forward(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Textbook full-sequence causal forward, no paging, no chunks: logits [S, V]."""
    a = model.args
    s = len(tokens)
    x = model.embed_tokens(torch.tensor(tokens))
    cos, sin = model.rope_cos[:s], model.rope_sin[:s]
    for layer in model.blocks():
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = apply_rope(at.q_proj(h).view(s, a.n_heads, a.head_dim).transpose(0, 1), cos, sin)
        k = apply_rope(at.k_proj(h).view(s, a.n_kv_heads, a.head_dim).transpose(0, 1), cos, sin)
        v = at.v_proj(h).view(s, a.n_kv_heads, a.head_dim).transpose(0, 1)
        g = a.n_heads // a.n_kv_heads
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), is_causal=True
        )
        x = x + at.o_proj(out.transpose(0, 1).reshape(s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x))


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def fresh_kv(model: Transformer, n_blocks: int = 16) -> tuple[PagedKV, list[int]]:
    kv = PagedKV.allocate(model.args, n_blocks, device=torch.device("cpu"))
    table = kv.take(n_blocks)
    assert table is not None
    return kv, table[::-1]  # a non-identity table, so paging bugs show


@pytest.mark.parametrize("n", [1, 15, 16, 17, 50])
def test_paged_prefill_matches_dense_reference(model: Transformer, n: int) -> None:
    tokens = prompt(n)
    kv, table = fresh_kv(model)
    logits = model.prefill(tokens, 0, table, kv)
    torch.testing.assert_close(logits, dense_forward(model, tokens)[-1], rtol=1e-4, atol=1e-4)


def test_decode_continues_prefill_like_the_dense_reference(model: Transformer) -> None:
    tokens = prompt(37)
    kv, table = fresh_kv(model)
    model.prefill(tokens[:30], 0, table, kv)
    for p in range(30, 37):
        logits = model.decode([tokens[p]], [p], [table], kv)[0]
    torch.testing.assert_close(logits, dense_forward(model, tokens)[-1], rtol=1e-4, atol=1e-4)


def test_decode_batch_of_sequences_at_different_positions(model: Transformer) -> None:
    a, b = prompt(20, seed=2), prompt(41, seed=3)
    kv = PagedKV.allocate(model.args, 8, device=torch.device("cpu"))
    ta, tb = kv.take(3), kv.take(4)
    assert ta is not None and tb is not None
    model.prefill(a[:-1], 0, ta, kv)
    model.prefill(b[:-1], 0, tb, kv)
    logits = model.decode([a[-1], b[-1]], [19, 40], [ta, tb], kv)
    torch.testing.assert_close(logits[0], dense_forward(model, a)[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], dense_forward(model, b)[-1], rtol=1e-4, atol=1e-4)


FAST_KV_TOL = 1e-5
"""The fast path's promise (float32): a hit's KV and logits equal recomputation within this."""


def _full_and_hit(model: Transformer, tokens: list[int], cut: int, chunk: int
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(k, v, logits) of a full prefill and of a hit: KV of [0, cut) copied in, [cut, n) computed,
    both in chunks of `chunk` tokens."""
    n = len(tokens)
    kv_full, t_full = fresh_kv(model)
    logits_full = model.prefill(tokens, 0, t_full, kv_full, chunk_tokens=chunk)
    k_full, v_full = kv_full.gather(t_full, n)
    kv_hit = PagedKV.allocate(model.args, 16, device=torch.device("cpu"))
    t_hit = kv_hit.take(16)
    assert t_hit is not None
    if cut:
        kv_hit.scatter(t_hit, k_full[:, :, :cut].clone(), v_full[:, :, :cut].clone())
    logits_hit = model.prefill(tokens[cut:], cut, t_hit, kv_hit, chunk_tokens=chunk)
    k_hit, v_hit = kv_hit.gather(t_hit, n)
    return (k_full, v_full, logits_full), (k_hit, v_hit, logits_hit)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize(("n", "cut"), [(17, 16), (64, 32), (70, 48), (33, 0)])
def test_deterministic_suffix_prefill_after_restored_prefix_is_bitwise_equal(
    tiny_dir: Path, attn_impl: str, n: int, cut: int
) -> None:
    # The cache-hit path in deterministic mode (one-block chunks): KV of [0, cut) is copied in
    # from elsewhere, only [cut, n) is computed, by the very calls of the full prefill.
    model = load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl=attn_impl).model
    full, hit = _full_and_hit(model, prompt(n, seed=n), cut, BLOCK_SIZE)
    for a, b in zip(full, hit, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize(("n", "cut", "chunk"),
                         [(17, 16, 2048), (64, 32, 2048), (70, 48, 32), (200, 112, 64),
                          (200, 0, 48)])
def test_fast_suffix_prefill_after_restored_prefix_is_within_tolerance(
    tiny_dir: Path, attn_impl: str, n: int, cut: int, chunk: int
) -> None:
    # The fast path: the suffix is computed by other calls (other row counts) than in the full
    # prefill, so the bits may differ; the values may not, beyond FAST_KV_TOL.
    model = load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl=attn_impl).model
    full, hit = _full_and_hit(model, prompt(n, seed=n), cut, chunk)
    for a, b in zip(full, hit, strict=True):
        torch.testing.assert_close(b, a, rtol=FAST_KV_TOL, atol=FAST_KV_TOL)
    # and the cached part is the full prefill's bytes themselves (copied, not recomputed)
    assert torch.equal(hit[0][:, :, :cut], full[0][:, :, :cut])


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("chunk", [16, 48, 2048])
def test_chunked_prefill_matches_dense_reference_at_any_chunk(
    tiny_dir: Path, attn_impl: str, chunk: int
) -> None:
    model = load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl=attn_impl).model
    tokens = prompt(150, seed=4)
    kv, table = fresh_kv(model)
    logits = model.prefill(tokens, 0, table, kv, chunk_tokens=chunk)
    torch.testing.assert_close(logits, dense_forward(model, tokens)[-1], rtol=1e-4, atol=1e-4)


def test_long_later_chunks_take_the_split_attention_and_match_the_reference(
    tiny_dir: Path
) -> None:
    # Chunks of >= 512 queries after the first attend to the prefix and to themselves apart,
    # merged by log-sum-exp (CPU); the result is the same function as one masked call.
    model = load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl="sdpa").model
    tokens = prompt(1100, seed=5)
    kv = PagedKV.allocate(model.args, 70, device=torch.device("cpu"))
    table = kv.take(70)
    assert table is not None
    logits = model.prefill(tokens, 0, table[::-1], kv, chunk_tokens=512)
    torch.testing.assert_close(logits, dense_forward(model, tokens)[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_packed_prefill_of_several_sequences_equals_each_alone(
    tiny_dir: Path, attn_impl: str
) -> None:
    # A fresh prompt, a later chunk of a second one (its first 32 tokens already in place) and
    # a one-token chunk, in one forward.
    model = load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl=attn_impl).model
    kv = PagedKV.allocate(model.args, 24, device=torch.device("cpu"))
    a, b, c = prompt(70, seed=21), prompt(90, seed=22), prompt(17, seed=23)
    ta, tb, tc = (kv.take(n) for n in (5, 6, 2))
    assert ta is not None and tb is not None and tc is not None
    model.prefill(b[:32], 0, tb, kv)
    model.prefill(c[:16], 0, tc, kv)
    packed = model.prefill_packed([(a, 0, ta), (b[32:], 32, tb), (c[16:], 16, tc)], kv)
    k_packed, v_packed = kv.gather(tb, 90)
    alone = [model.prefill(a, 0, ta, kv), model.prefill(b[32:], 32, tb, kv),
             model.prefill(c[16:], 16, tc, kv)]
    k_alone, v_alone = kv.gather(tb, 90)
    torch.testing.assert_close(packed, torch.stack(alone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_packed, k_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_packed, v_alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[1], dense_forward(model, b)[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_batched_decode_equals_one_sequence_at_a_time(tiny_dir: Path, attn_impl: str) -> None:
    # Sequences of different lengths in one padded batch: each row as if decoded alone.
    model = load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl=attn_impl).model
    lengths = [1, 16, 17, 40, 95]
    kv = PagedKV.allocate(model.args, 32, device=torch.device("cpu"))
    tables, prompts = [], []
    for i, n in enumerate(lengths):
        taken = kv.take(n // BLOCK_SIZE + 1)
        assert taken is not None
        t = taken[::-1]  # a non-identity table, so paging bugs show
        p = prompt(n + 1, seed=10 + i)
        if n:
            model.prefill(p[:n], 0, t, kv)
        tables.append(t)
        prompts.append(p)
    batch = model.decode([p[-1] for p in prompts], lengths, tables, kv)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(batch[b], dense_forward(model, p)[-1], rtol=1e-4, atol=1e-4)
        alone = model.decode([p[-1]], [lengths[b]], [tables[b]], kv)[0]
        torch.testing.assert_close(batch[b], alone, rtol=1e-5, atol=1e-5)


def test_prefill_rejects_unaligned_start_and_overlong(model: Transformer) -> None:
    kv, table = fresh_kv(model)
    with pytest.raises(ValueError, match="multiple of 16"):
        model.prefill([1, 2], 5, table, kv)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.prefill([1], model.args.max_seq_len, table, kv)
    with pytest.raises(ValueError, match="chunk_tokens 24"):
        model.prefill([1, 2], 0, table, kv, chunk_tokens=24)
    with pytest.raises(ValueError, match="block table has 1 blocks"):
        model.prefill(list(range(20)), 0, table[:1], kv)


def test_checkpoint_generation_is_deterministic_and_digest_is_file_sha256(tmp_path: Path) -> None:
    import hashlib

    args = ModelArgs.from_preset("tiny")
    d1 = generate_checkpoint(tmp_path / "a", args, seed=7)
    d2 = generate_checkpoint(tmp_path / "b", args, seed=7)
    d3 = generate_checkpoint(tmp_path / "c", args, seed=8)
    raw = hashlib.sha256((tmp_path / "a" / "model.safetensors").read_bytes()).hexdigest()
    assert d1 == d2 == "sha256:" + raw
    assert d3 != d1
    assert weights_digest(tmp_path / "a") == d1
    # readable by a serving uid other than the one that generated it (the image runs as 10001)
    assert (tmp_path / "a" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_loader_reads_hf_config_and_rejects_mismatched_weights(
    tiny_dir: Path, tmp_path: Path
) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    loaded = load_checkpoint(tiny_dir, device=torch.device("cpu"))
    assert loaded.args == ModelArgs.from_preset("tiny")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes())
    (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(bad, device=torch.device("cpu"))


def test_rope_hash_and_attn_id_change_with_their_inputs() -> None:
    base = ModelArgs.from_preset("tiny")
    other_theta = ModelArgs(**{**base.to_dict(), "rope_theta": 500000.0})
    scaled = ModelArgs(**{**base.to_dict(), "rope_scaling": {"type": "linear", "factor": 2.0}})
    sdpa = ModelArgs(**{**base.to_dict(), "attn_impl": "sdpa"})
    hashes = {base.rope_config_hash(), other_theta.rope_config_hash(), scaled.rope_config_hash()}
    assert len(hashes) == 3
    assert base.rope_config_hash() == ModelArgs.from_preset("tiny").rope_config_hash()
    assert base.attn_impl_id() != sdpa.attn_impl_id()


def test_linear_rope_scaling_divides_positions() -> None:
    base = Transformer(ModelArgs.from_preset("tiny"))
    scaled = Transformer(
        ModelArgs(**{**ModelArgs.from_preset("tiny").to_dict(),
                     "rope_scaling": {"type": "linear", "factor": 2.0}})
    )
    torch.testing.assert_close(scaled.rope_cos[10], base.rope_cos[5])


def test_paged_kv_allocator_returns_none_when_full() -> None:
    kv = PagedKV.allocate(ModelArgs.from_preset("tiny"), 3, device=torch.device("cpu"))
    assert kv.take(2) == [0, 1]
    assert kv.take(2) is None
    kv.give_back([0, 1])
    assert kv.num_free_blocks == 3


def test_byte_tokenizer_round_trip_and_streaming() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_id and max(ids[1:]) < 256
    assert tok.decode(ids) == "héllo ✓"
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "héllo ✓"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_cuda_chunked_prefill_and_batched_decode_match_the_cpu(
    tiny_dir: Path, attn_impl: str
) -> None:
    """The device kernels (SDPA's flash / memory-efficient paths, indexed copies on the GPU)
    compute what the CPU does, to float32 tolerance (1e-3: other kernels, other rounding)."""
    cpu = load_checkpoint(tiny_dir, device=torch.device("cpu"), attn_impl=attn_impl).model
    gpu = load_checkpoint(tiny_dir, device=torch.device("cuda"), attn_impl=attn_impl).model
    lengths = [20, 150]
    logits = []
    for model in (cpu, gpu):
        kv = PagedKV.allocate(model.args, 32, device=model.device)
        tables = [kv.take(n // BLOCK_SIZE + 1) for n in lengths]
        prompts = [prompt(n + 1, seed=30 + n) for n in lengths]
        out = []
        for t, p, n in zip(tables, prompts, lengths, strict=True):
            assert t is not None
            out.append(model.prefill(p[:n], 0, t, kv, chunk_tokens=64).cpu())
        out.append(model.decode([p[-1] for p in prompts], lengths, tables, kv).cpu())
        logits.append(out)
    for c, g in zip(*logits, strict=True):
        torch.testing.assert_close(g, c, rtol=1e-3, atol=1e-3)


# ---- oneDNN-packed weights (bf16 on a CPU with bf16 instructions) ------------------------------

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_packing_supported(torch.device("cpu"), torch.bfloat16),
    reason="this CPU or torch build has no oneDNN bf16")

BF16_TOL = 5e-2
"""Plain vs packed bf16 logits: a fused or prepacked matmul rounds other partial sums (bf16's
eps is 7.8e-3; the tiny model's logits are O(1))."""


def bf16_model(tiny_dir: Path, *, packed: bool, attn_impl: str = "sdpa") -> Transformer:
    model = load_checkpoint(tiny_dir, device=torch.device("cpu"), dtype="bf16",
                            attn_impl=attn_impl).model
    if packed:
        model.pack_linear_weights()
    return model


@needs_onednn_bf16
def test_packed_weights_compute_the_plain_models_prefill_and_decode(tiny_dir: Path) -> None:
    plain, packed = bf16_model(tiny_dir, packed=False), bf16_model(tiny_dir, packed=True)
    assert isinstance(packed.lm_head, PackedLinear)
    tokens = prompt(70, seed=31)
    out = []
    for model in (plain, packed):
        kv, table = fresh_kv(model)
        # a full prefill, a later chunk, a one-row prefill and a decode step
        first = model.prefill(tokens[:48], 0, table, kv)
        later = model.prefill(tokens[48:69], 48, table, kv)
        step = model.decode([tokens[69]], [69], [table], kv)[0]
        one_kv, one_table = fresh_kv(model, 2)
        one = model.prefill(tokens[:1], 0, one_table, one_kv)
        out.append((first, later, step, one, *kv.gather(table, 70)))
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=BF16_TOL, atol=BF16_TOL)


@needs_onednn_bf16
@pytest.mark.parametrize(("n", "cut"), [(17, 16), (70, 48), (33, 0)])
def test_packed_weights_keep_a_deterministic_hit_bitwise_equal(
    tiny_dir: Path, n: int, cut: int
) -> None:
    model = bf16_model(tiny_dir, packed=True)
    full, hit = _full_and_hit(model, prompt(n, seed=n), cut, BLOCK_SIZE)
    for a, b in zip(full, hit, strict=True):
        assert torch.equal(a, b)


@needs_onednn_bf16
def test_pack_refuses_what_onednn_cannot_run(tiny_dir: Path) -> None:
    fp32 = load_checkpoint(tiny_dir, device=torch.device("cpu")).model
    with pytest.raises(ValueError, match="bf16"):
        fp32.pack_linear_weights()
