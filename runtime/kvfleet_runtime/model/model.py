"""The reference model: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

One readable file in the manner of gpt-fast: a `ModelArgs` dataclass with presets, small modules,
and prefill and decode as separate functions over a paged KV (`PagedKV`, blocks of 16 tokens).

Why prefill runs in chunks of exactly one block, aligned to absolute positions: the prefix cache
replaces the KV of the first `m` tokens (m a multiple of 16) by stored bytes and prefills only the
rest. On CPU, torch's matmul gives bit-different rows for the same input row depending on how
many rows the call has (a [5, D] call and a [2000, D] call disagree in the last bits). If prefill
computed all tokens in one call, a suffix prefill would not reproduce the full prefill's KV and a
cache hit could change the answer. With chunks aligned to the 16-token grid, the tokens after a
block-aligned hit are computed by exactly the same calls, on the same shapes and the same inputs,
as in a full prefill, so the KV and the logits are bitwise equal by construction (same process,
same device, same thread count). Decode computes one row per sequence, so KV written by decode is
never stored in the cache (see the engine).

Weight names follow Hugging Face's Llama (`q_proj`, `gate_proj`, ...), and RoPE rotates halves
(`rotate_half`), so Llama-format checkpoints load without permuting q/k.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvfleet_runtime.wire import BLOCK_SIZE

ATTN_IMPLS = ("eager", "sdpa")


@dataclass(slots=True)
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 259
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 2048
    attn_impl: str = "eager"

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl {self.attn_impl!r} is not one of {ATTN_IMPLS}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @classmethod
    def from_preset(cls, name: str) -> ModelArgs:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4

    def rope_config_hash(self) -> str:
        """SHA-256 of the canonical JSON of everything that decides the rotary embedding."""
        canonical = json.dumps(
            {"rope_theta": float(self.rope_theta), "rope_scaling": self.rope_scaling,
             "head_dim": self.head_dim},
            sort_keys=True, separators=(",", ":"),
        )
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    def attn_impl_id(self) -> str:
        """Names the attention arithmetic; bump the version when the computation changes."""
        return f"{self.attn_impl}-chunk{BLOCK_SIZE}-v1"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, dict[str, Any]] = {
    # Tests: as small as still exercises GQA (2 query heads per kv head) and 2 layers.
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128,
                 max_seq_len=2048),
    # Benchmarks and the demo: a few layers, 2,000-token prompts fit.
    "small": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
                  intermediate_size=688, max_seq_len=4096),
}


@dataclass(slots=True)
class PagedKV:
    """The engine's working KV: per layer, `num_blocks` blocks of `BLOCK_SIZE` tokens.

    k, v: [n_layers, num_blocks, n_kv_heads, BLOCK_SIZE, head_dim]. A sequence owns a block table
    (a list of block ids); token at position p lives in block `table[p // 16]`, slot `p % 16`.
    """

    k: Tensor
    v: Tensor
    free_blocks: list[int] = field(default_factory=list)

    @classmethod
    def allocate(cls, args: ModelArgs, num_blocks: int, *, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> PagedKV:
        shape = (args.n_layers, num_blocks, args.n_kv_heads, BLOCK_SIZE, args.head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k=k, v=v, free_blocks=list(range(num_blocks - 1, -1, -1)))

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def take(self, n: int) -> list[int] | None:
        """Hand out n free blocks, or None when there is not enough room."""
        if n > len(self.free_blocks):
            return None
        return [self.free_blocks.pop() for _ in range(n)]

    def give_back(self, blocks: Sequence[int]) -> None:
        self.free_blocks.extend(reversed(blocks))

    def gather(self, table: Sequence[int], n_tokens: int) -> tuple[Tensor, Tensor]:
        """K, V of a sequence's first n_tokens: [n_layers, n_kv_heads, n_tokens, head_dim]."""
        n_blocks = -(-n_tokens // BLOCK_SIZE)
        idx = torch.tensor(list(table[:n_blocks]), dtype=torch.long, device=self.k.device)
        k = self.k.index_select(1, idx)  # [L, nb, H, 16, D]
        v = self.v.index_select(1, idx)
        n_layers, _, n_heads, _, head_dim = k.shape
        k = k.permute(0, 2, 1, 3, 4).reshape(n_layers, n_heads, n_blocks * BLOCK_SIZE, head_dim)
        v = v.permute(0, 2, 1, 3, 4).reshape(n_layers, n_heads, n_blocks * BLOCK_SIZE, head_dim)
        return k[:, :, :n_tokens], v[:, :, :n_tokens]

    def scatter(self, table: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Write KV of positions [0, n) (k, v: [n_layers, n_kv_heads, n, head_dim]) to blocks."""
        n = int(k.shape[2])
        n_full = n // BLOCK_SIZE
        if n_full:  # one indexed copy for all full blocks
            idx = torch.tensor(list(table[:n_full]), dtype=torch.long, device=self.k.device)
            for pool, src in ((self.k, k), (self.v, v)):
                n_layers, n_heads, _, head_dim = src.shape
                blocks = src[:, :, : n_full * BLOCK_SIZE].reshape(
                    n_layers, n_heads, n_full, BLOCK_SIZE, head_dim).transpose(1, 2)
                pool[:, idx] = blocks.to(pool.dtype)  # [L, nb, H, 16, D]
        if n > n_full * BLOCK_SIZE:
            lo, block = n_full * BLOCK_SIZE, table[n_full]
            self.k[:, block, :, : n - lo] = k[:, :, lo:].to(self.k.dtype)
            self.v[:, block, :, : n - lo] = v[:, :, lo:].to(self.v.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies [head_dim // 2], with optional linear or llama3 scaling."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64)
                                          / args.head_dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.to(torch.float32)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [H, S, D]; cos, sin: [S, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # x: [S, dim] -> q [Hq, S, D], k, v [Hkv, S, D] (q and k rotated)
        s, a = x.shape[0], self.args
        q = self.q_proj(x).view(s, a.n_heads, a.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(s, a.n_kv_heads, a.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(s, a.n_kv_heads, a.head_dim).transpose(0, 1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, q_start: int) -> Tensor:
        """Causal GQA of queries at [q_start, q_start + S) over keys [0, T): -> [S, Hq*D]."""
        a = self.args
        n_q, n_k = q.shape[1], k.shape[1]
        group = a.n_heads // a.n_kv_heads
        q_pos = torch.arange(q_start, q_start + n_q, device=q.device)
        allowed = torch.arange(n_k, device=q.device)[None, :] <= q_pos[:, None]  # [S, T]
        if a.attn_impl == "sdpa":
            k_rep = k.repeat_interleave(group, dim=0)  # [Hq, T, D]
            v_rep = v.repeat_interleave(group, dim=0)
            out = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=allowed)
        else:
            qg = q.view(a.n_kv_heads, group, n_q, a.head_dim)  # [Hkv, G, S, D]
            scores = qg @ k.transpose(-1, -2)[:, None] / math.sqrt(a.head_dim)  # [Hkv, G, S, T]
            scores = scores.masked_fill(~allowed, float("-inf"))
            out = (torch.softmax(scores, dim=-1) @ v[:, None]).view(a.n_heads, n_q, a.head_dim)
        return out.transpose(0, 1).reshape(n_q, a.n_heads * a.head_dim)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)


class Transformer(nn.Module):
    rope_cos: Tensor  # [max_seq_len, head_dim]
    rope_sin: Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        positions = torch.arange(args.max_seq_len, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(args))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_seq_len, D]
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def blocks(self) -> list[TransformerBlock]:
        return [b for b in self.layers if isinstance(b, TransformerBlock)]

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], start_pos: int, table: Sequence[int],
                kv: PagedKV) -> Tensor:
        """Compute KV for tokens at positions [start_pos, start_pos + S), return last logits [V].

        KV of positions [0, start_pos) must already be in the table's blocks (cached or computed).
        `start_pos` must sit on a block boundary; chunks are the 16-token blocks themselves.
        """
        if start_pos % BLOCK_SIZE != 0:
            raise ValueError(f"start_pos {start_pos} is not a multiple of {BLOCK_SIZE}")
        if not tokens:
            raise ValueError("prefill needs at least one token")
        if start_pos + len(tokens) > self.args.max_seq_len:
            raise ValueError(
                f"{start_pos + len(tokens)} positions exceed max_seq_len {self.args.max_seq_len}"
            )
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        logits = None
        for lo in range(0, len(tokens), BLOCK_SIZE):
            chunk = ids[lo : lo + BLOCK_SIZE]
            logits = self._prefill_chunk(chunk, start_pos + lo, table, kv)
        assert logits is not None
        return logits

    def _prefill_chunk(self, chunk: Tensor, pos: int, table: Sequence[int], kv: PagedKV) -> Tensor:
        # chunk: [S] tokens at positions [pos, pos + S), all inside block table[pos // 16]
        n = int(chunk.shape[0])
        block, slot = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        cos, sin = self.rope_cos[pos : pos + n], self.rope_sin[pos : pos + n]
        x = self.embed_tokens(chunk)  # [S, dim]
        for i, layer in enumerate(self.blocks()):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            kv.k[i, block, :, slot : slot + n] = k
            kv.v[i, block, :, slot : slot + n] = v
            k_all, v_all = _layer_kv(kv, i, table, pos + n)  # [Hkv, pos + S, D]
            x = x + attn.o_proj(attn.attend(q, k_all, v_all, pos))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits: Tensor = self.lm_head(self.norm(x[-1:]))[0]
        return logits

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               tables: Sequence[Sequence[int]], kv: PagedKV) -> Tensor:
        """One step for a batch: token b sits at positions[b]; returns logits [B, V]."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [B, D]
        x = self.embed_tokens(ids)  # [B, dim]
        a = self.args
        for i, layer in enumerate(self.blocks()):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            bsz = h.shape[0]
            q = attn.q_proj(h).view(bsz, a.n_heads, 1, a.head_dim)
            k = attn.k_proj(h).view(bsz, a.n_kv_heads, 1, a.head_dim)
            v = attn.v_proj(h).view(bsz, a.n_kv_heads, 1, a.head_dim)
            q = apply_rope(q, cos[:, None, None], sin[:, None, None])
            k = apply_rope(k, cos[:, None, None], sin[:, None, None])
            outs = []
            for b, p in enumerate(positions):
                kv.k[i, tables[b][p // BLOCK_SIZE], :, p % BLOCK_SIZE] = k[b, :, 0]
                kv.v[i, tables[b][p // BLOCK_SIZE], :, p % BLOCK_SIZE] = v[b, :, 0]
                k_all, v_all = _layer_kv(kv, i, tables[b], p + 1)
                outs.append(attn.attend(q[b], k_all, v_all, p))
            x = x + attn.o_proj(torch.cat(outs, dim=0))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits: Tensor = self.lm_head(self.norm(x))
        return logits


def _layer_kv(
    kv: PagedKV, layer: int, table: Sequence[int], n_tokens: int
) -> tuple[Tensor, Tensor]:
    # -> k, v: [Hkv, n_tokens, D], gathered from the sequence's blocks
    n_blocks = -(-n_tokens // BLOCK_SIZE)
    idx = torch.tensor(list(table[:n_blocks]), dtype=torch.long, device=kv.k.device)
    k = kv.k[layer].index_select(0, idx)  # [nb, Hkv, 16, D]
    v = kv.v[layer].index_select(0, idx)
    nb, h, _, d = k.shape
    k = k.transpose(0, 1).reshape(h, nb * BLOCK_SIZE, d)[:, :n_tokens]
    v = v.transpose(0, 1).reshape(h, nb * BLOCK_SIZE, d)[:, :n_tokens]
    return k, v
