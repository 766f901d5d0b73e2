"""The reference model: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

One readable file in the manner of gpt-fast: a `ModelArgs` dataclass with presets, small modules,
and prefill and decode as separate functions over a paged KV (`PagedKV`, blocks of 16 tokens).

Prefill runs in chunks of whole blocks as large as the caller's budget (`chunk_tokens`, the
engine's token budget per step): per layer per chunk, one indexed write of the chunk's K/V into
its blocks, one gather of the sequence's KV over its block table and one attention call (torch
SDPA, or transformers' eager arithmetic); a chunk that starts the sequence is plain causal, a
later one attends to the prefix unmasked and to itself causally (merged by log-sum-exp on CPU, an
offset causal mask elsewhere). The chunks of several sequences can share one forward
(`prefill_packed`). Decode is one forward per step for the batch: one indexed write of the new
rows, one padded gather of every sequence's KV, one attention call with a length mask.

Determinism is the caller's choice. The prefix cache replaces the KV of the first `m` tokens (m a
multiple of 16) by stored bytes and prefills only the rest. CPU and GPU kernels round a row
differently depending on the call's shape (on this project's CPU, torch's matmul gives other
bits for a row in a 1-, 2- or 5-row call than in a 4,096-row one, and a softmax or `probs @ v`
over T keys sums in an order that depends on T), so a suffix prefilled in other chunks than the
full prefill used agrees with it to float tolerance (about 1e-6 in float32 logits), not bitwise.
`chunk_tokens=BLOCK_SIZE` makes every block boundary a chunk boundary: the tokens after any
block-aligned hit are then computed by exactly the calls of a full prefill, on the same shapes and
inputs, so KV and logits are bitwise equal by construction (same process, device, thread count).
No coarser aligned rule has that property for hits that may end at any block: a C-token grid is
bitwise only if hits are cut to multiples of C. Decode computes one row per sequence, so KV
written by decode is never stored in the cache (see the engine).

Weight names follow Hugging Face's Llama (`q_proj`, `gate_proj`, ...), and RoPE rotates halves
(`rotate_half`), so Llama-format checkpoints load without permuting q/k. The architectures it
computes exactly like transformers (Llama, Mistral's sliding window, Qwen2's q/k/v bias, Qwen3's
q/k norm, tied embeddings, the rope variants) and how a config maps onto `ModelArgs` live in
`kvfleet_runtime.model.architectures`; operations follow transformers' order and precision (norms in
float32, softmax in float32, RoPE tables in float32), so float32 logits agree to ~1e-6.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvfleet_runtime.cache import PagedBlocks
from kvfleet_runtime.model.architectures import ATTN_IMPLS, PRESETS, ModelArgs
from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = [
    "ATTN_IMPLS", "PREFILL_CHUNK_TOKENS", "PRESETS", "ModelArgs", "PackedLinear", "PagedKV",
    "Transformer", "apply_rope", "onednn_packing_supported", "rope_inv_freq",
]

PREFILL_CHUNK_TOKENS = 2048
"""`Transformer.prefill`'s chunk when the caller names none: long enough that the matmuls run at
full speed, short enough that a chunk's attention scores ([Hq, chunk, T] in the eager path) fit."""


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


@dataclass(slots=True, eq=False)
class PagedKV(PagedBlocks):
    """The engine's working KV: per layer, `num_blocks` blocks of `BLOCK_SIZE` tokens, and T0 of
    the prefix cache bound to it (one pool per device, see `kvfleet_runtime.cache`).

    k, v: [n_layers, num_blocks, n_kv_heads, BLOCK_SIZE, head_dim]. A sequence owns a block table
    (a list of block ids); token at position p lives in block `table[p // 16]`, slot `p % 16`.
    Blocks are ref-counted (`take`, `share`, `give_back`): a cached prefix block may sit in
    several tables at once, and nobody writes it (computation resumes at the first unmatched
    block).
    """

    @classmethod
    def allocate(cls, args: ModelArgs, num_blocks: int, *, device: torch.device,
                 dtype: torch.dtype | None = None) -> PagedKV:
        """`dtype` defaults to the serving dtype (`args.dtype`): the KV is what the model wrote."""
        dtype = dtype or torch_dtype(args.dtype)
        shape = (args.n_layers, num_blocks, args.n_kv_heads, BLOCK_SIZE, args.head_dim)
        return cls.of_shape(shape, dtype, device)

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


def onednn_packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN can run this model's matmuls from prepacked weights (`PackedLinear`): bf16 on a
    CPU with bf16 instructions (AVX-512 BF16 or AMX), in a torch built with oneDNN."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedLinear(nn.Linear):
    """`nn.Linear` whose weight oneDNN reordered once into its own blocked layout (what vLLM's
    CPU backend does with `onednn_mm`), instead of on every call.

    torch's bf16 `F.linear` on CPU is already oneDNN (AMX where the CPU has it), but it hands
    oneDNN the weight in its plain layout, to be reordered inside every call; with few rows
    (decode, short chunks) that reorder is a large part of the call. Measured on this
    project's 2-core AVX-512/AMX VM, one thread, Qwen2-0.5B's shapes: 0.52-0.67x the time of
    `F.linear` at 4-64 rows, 0.72-1.0x at 576-2,048 rows, and the same bits as `F.linear` at
    4-2,048 rows (not at one row; docs/replica.md, "A miss's prefill"). The plain weight is
    released unless `keep_weight` (a tied embedding still needs it); calling with it released
    fails loudly."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, keep_weight: bool = False) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        # Packed for no particular row count: oneDNN then picks a layout that serves any.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        kept = weight if keep_weight else weight.new_empty(0)
        self.weight = kept if isinstance(kept, nn.Parameter) else nn.Parameter(
            kept, requires_grad=False)
        self.register_parameter("bias", None if bias is None else nn.Parameter(
            bias.detach(), requires_grad=False))

    @classmethod
    def of(cls, *linears: nn.Linear, keep_weight: bool = False) -> PackedLinear:
        """One packed matmul for `linears` side by side (their outputs concatenated)."""
        weight = linears[0].weight if len(linears) == 1 else torch.cat(
            [lin.weight for lin in linears])
        biases = [lin.bias for lin in linears]
        bias = None if any(b is None for b in biases) else torch.cat(
            [b for b in biases if b is not None])
        if bias is None and any(b is not None for b in biases):
            raise ValueError("packing linears of which only some have a bias")
        return cls(weight, bias, keep_weight=keep_weight)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [],
                                                         "")
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # As transformers does: normalize in float32, cast back, then scale (matters in bf16).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: Tensor = self.weight * h.to(x.dtype)
        return out


def rope_inv_freq(args: ModelArgs) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale, per rope type.

    Computed with transformers' operations in its order and precision (float32), so the tables
    agree to the last bits rather than to a tolerance. `dynamic` (NTK) rescales only beyond
    `max_position_embeddings`, which is also the context this model serves: inside it the
    frequencies are the default ones, exactly."""
    dim = args.head_dim
    base = args.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base ** exponents)
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_mid, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(scaling, dim, base, factor)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _yarn(scaling: dict[str, Any], dim: int, base: float, factor: float
          ) -> tuple[Tensor, float]:
    old_len = float(scaling["original_max_position_embeddings"])

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all:
            attention = mscale_of(factor, float(mscale)) / mscale_of(factor, float(mscale_all))
        else:
            attention = mscale_of(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [H, S, D]; cos, sin: [S, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.args = args
        self.window = args.window_of(layer)
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.dim, q, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, kv, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, kv, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q, args.dim, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.qkv_proj: PackedLinear | None = None
        """q, k and v in one packed matmul, once `Transformer.pack_linear_weights` ran."""

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # x: [S, dim] -> q [Hq, S, D], k, v [Hkv, S, D] (q and k normed when the model says so,
        # then rotated). In decode, S is the batch and cos/sin hold each row's position.
        s, a = x.shape[0], self.args
        if self.qkv_proj is not None:
            q_rows, k_rows, v_rows = self.qkv_proj(x).split(
                [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim],
                dim=-1)
        else:
            q_rows, k_rows, v_rows = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q_rows.view(s, a.n_heads, a.head_dim)
        k = k_rows.view(s, a.n_kv_heads, a.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v_rows.view(s, a.n_kv_heads, a.head_dim).transpose(0, 1)
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, q_start: int) -> Tensor:
        """Causal GQA of queries at [q_start, q_start + S) over keys [0, T): -> [S, Hq*D].

        With a sliding window W, a query at p sees keys (p - W, p] (transformers' rule)."""
        a = self.args
        n_q, n_k = q.shape[1], k.shape[1]
        if a.attn_impl == "sdpa" and self.window is None and n_k == q_start + n_q:
            if q_start == 0:  # a chunk that starts the sequence: plain causal, the fastest case
                out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                     enable_gqa=True)[0]
                return out.transpose(0, 1).reshape(n_q, a.n_heads * a.head_dim)
            if q.device.type == "cpu" and _CPU_FLASH is not None and n_q >= _SPLIT_MIN_QUERIES:
                out = _prefix_then_causal(q, k, v, q_start)
                return out.transpose(0, 1).reshape(n_q, a.n_heads * a.head_dim)
        q_pos = torch.arange(q_start, q_start + n_q, device=q.device)
        k_pos = torch.arange(n_k, device=q.device)[None, :]
        allowed = k_pos <= q_pos[:, None]  # [S, T]: the causal mask offset by the chunk's start
        if self.window is not None:
            allowed = allowed & (k_pos > q_pos[:, None] - self.window)
        if a.attn_impl == "sdpa":
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed,
                                                 enable_gqa=True)[0]
        else:
            group = a.n_heads // a.n_kv_heads
            qg = q.view(a.n_kv_heads, group, n_q, a.head_dim)  # [Hkv, G, S, D]
            scores = (qg @ k.transpose(-1, -2)[:, None]) * a.head_dim**-0.5  # [Hkv, G, S, T]
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = (probs @ v[:, None]).view(a.n_heads, n_q, a.head_dim)
        return out.transpose(0, 1).reshape(n_q, a.n_heads * a.head_dim)

    def attend_batch(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """One query per sequence: q [B, Hq, D] over k, v [B, Hkv, T, D] where `allowed`
        [B, T] is True: -> [B, Hq*D]."""
        a = self.args
        b, n_k = q.shape[0], k.shape[2]
        if a.attn_impl == "sdpa":
            out = F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                 attn_mask=allowed[:, None, None, :],
                                                 enable_gqa=True)  # [B, Hq, 1, D]
        else:
            group = a.n_heads // a.n_kv_heads
            qg = q.view(b, a.n_kv_heads, group, 1, a.head_dim)  # [B, Hkv, G, 1, D]
            scores = (qg @ k.transpose(-1, -2)[:, :, None]) * a.head_dim**-0.5  # [B,Hkv,G,1,T]
            scores = scores.masked_fill(~allowed.view(b, 1, 1, 1, n_k), float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = probs @ v[:, :, None]  # [B, Hkv, G, 1, D]
        return out.reshape(b, a.n_heads * a.head_dim)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""SDPA's CPU flash kernel, called directly because it also returns the log-sum-exp."""

_SPLIT_MIN_QUERIES = 512
"""Below this many queries a masked call is cheaper than the split (which copies the prefix's
K/V per query head). Measured on the small preset over 2,000 prefix keys, split vs masked: 16
queries 1.4 vs 0.8 ms, 256: 19.0 vs 17.0 ms, 512: 34.4 vs 40.9 ms."""


def _prefix_then_causal(q: Tensor, k: Tensor, v: Tensor, q_start: int) -> Tensor:
    """A later chunk's causal attention (CPU): q [Hq, S, D] at [q_start, q_start + S) over keys
    [0, q_start + S) -> [Hq, S, D].

    A mask offset by the chunk's start makes the CPU kernel visit every masked pair (measured
    1.7x slower than this at 2,000 queries over 8,000 keys); instead the chunk attends to the
    prefix unmasked and to itself causally, and the two softmaxes are merged by their
    log-sum-exps: the same function, each half on the kernel's fast path."""
    assert _CPU_FLASH is not None
    group = q.shape[0] // k.shape[0]
    k_rep = k.repeat_interleave(group, dim=0)[None]  # [1, Hq, T, D]: this kernel has no GQA
    v_rep = v.repeat_interleave(group, dim=0)[None]
    qb = q[None]
    out_prefix, lse_prefix = _CPU_FLASH(qb, k_rep[:, :, :q_start], v_rep[:, :, :q_start])
    out_self, lse_self = _CPU_FLASH(qb, k_rep[:, :, q_start:], v_rep[:, :, q_start:],
                                    is_causal=True)
    top = torch.maximum(lse_prefix, lse_self)
    w_prefix = torch.exp(lse_prefix - top)[..., None]  # [1, Hq, S, 1]
    w_self = torch.exp(lse_self - top)[..., None]
    out: Tensor = ((out_prefix * w_prefix + out_self * w_self) / (w_prefix + w_self))[0]
    return out.to(q.dtype)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)
        self.gate_up_proj: PackedLinear | None = None
        """gate and up in one packed matmul, once `Transformer.pack_linear_weights` ran."""

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out: Tensor = self.down_proj(F.silu(gate) * up)
        return out


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)


class Transformer(nn.Module):
    """Built on any device, including `meta` (the loader's: no random init, no memory)."""

    rope_cos: Tensor  # [max_seq_len, head_dim], serving dtype, attention scaling applied
    rope_sin: Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # An explicit (uninitialized) weight skips Embedding's normal_ init: on the meta device
        # that op alone pulls in torch's Python meta kernels (sympy, ~160 MB resident).
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim,
                                         _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if self.embed_tokens.weight.device.type != "meta":
            self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the RoPE tables on the model's device in its dtype (after loading)."""
        inv_freq, scale = rope_inv_freq(self.args)
        positions = torch.arange(self.args.max_seq_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # as transformers: float32 products
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_seq_len, D]
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        self.rope_cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.rope_sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def blocks(self) -> list[TransformerBlock]:
        return [b for b in self.layers if isinstance(b, TransformerBlock)]

    def pack_linear_weights(self) -> None:
        """Run every matmul from oneDNN-prepacked weights (`PackedLinear`), q/k/v and gate/up
        each as one matmul (as vLLM fuses them). Only where `onednn_packing_supported`; the
        results agree with the plain path to float tolerance (a fused matmul is another shape),
        so a replica that packs computes every prefill and decode this way, hit or miss alike.
        """
        if not onednn_packing_supported(self.device, self.embed_tokens.weight.dtype):
            raise ValueError(f"oneDNN packing needs bf16 on a CPU with bf16 support, not "
                             f"{self.embed_tokens.weight.dtype} on {self.device}")
        for block in self.blocks():
            attn, mlp = block.self_attn, block.mlp
            if attn.qkv_proj is not None:
                continue  # packed already
            attn.qkv_proj = PackedLinear.of(attn.q_proj, attn.k_proj, attn.v_proj)
            attn.o_proj = PackedLinear.of(attn.o_proj)
            mlp.gate_up_proj = PackedLinear.of(mlp.gate_proj, mlp.up_proj)
            mlp.down_proj = PackedLinear.of(mlp.down_proj)
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                lin.weight = nn.Parameter(lin.weight.new_empty(0), requires_grad=False)
        if not isinstance(self.lm_head, PackedLinear):
            self.lm_head = PackedLinear.of(self.lm_head,
                                           keep_weight=self.args.tie_word_embeddings)

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], start_pos: int, table: Sequence[int],
                kv: PagedKV, *, chunk_tokens: int = PREFILL_CHUNK_TOKENS) -> Tensor:
        """Compute KV for tokens at positions [start_pos, start_pos + S), return last logits [V].

        KV of positions [0, start_pos) must already be in the table's blocks (cached or computed).
        `start_pos` must sit on a block boundary. The tokens are computed in chunks of
        `chunk_tokens` (a multiple of the block size): each chunk is one pass through the layers,
        and per layer one write of its KV, one gather of the sequence's KV and one attention
        call. `chunk_tokens=BLOCK_SIZE` is the deterministic rule (module docstring).
        """
        if chunk_tokens <= 0 or chunk_tokens % BLOCK_SIZE != 0:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a positive multiple of "
                             f"{BLOCK_SIZE}")
        logits = None
        for lo in range(0, max(len(tokens), 1), chunk_tokens):
            logits = self.prefill_packed(
                [(tokens[lo : lo + chunk_tokens], start_pos + lo, table)], kv)[0]
        assert logits is not None
        return logits

    @torch.inference_mode()
    def prefill_packed(self, chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
                       kv: PagedKV) -> Tensor:
        """One forward over the prompt chunks of several sequences: (tokens, start_pos, table)
        each, as in `prefill`; returns each chunk's last logits [N, V].

        The chunks' rows are packed into one batch for every matmul and one indexed KV write
        per layer; attention stays per chunk (one call each, over its own sequence's KV), since
        the sequences' lengths differ. A chunk's rows then meet other matmul shapes than they
        would alone, which is why deterministic mode never packs."""
        if not chunks:
            raise ValueError("prefill needs at least one chunk")
        device = self.device
        ids: list[int] = []
        positions: list[Tensor] = []
        seq_blocks: list[Tensor] = []
        ends: list[int] = []
        for tokens, start, table in chunks:
            end = start + len(tokens)
            if start % BLOCK_SIZE != 0:
                raise ValueError(f"start_pos {start} is not a multiple of {BLOCK_SIZE}")
            if not tokens:
                raise ValueError("prefill needs at least one token")
            if end > self.args.max_seq_len:
                raise ValueError(f"{end} positions exceed max_seq_len {self.args.max_seq_len}")
            n_blocks = -(-end // BLOCK_SIZE)
            if len(table) < n_blocks:
                raise ValueError(f"block table has {len(table)} blocks, positions up to {end} "
                                 f"need {n_blocks}")
            ids.extend(tokens)
            positions.append(torch.arange(start, end))
            seq_blocks.append(torch.tensor(list(table[:n_blocks]), dtype=torch.long))
            ends.append(end)
        pos = torch.cat(positions).to(device)  # [R]: every packed row's position
        write_blocks = torch.cat([blk[p // BLOCK_SIZE] for blk, p in zip(
            seq_blocks, positions, strict=True)]).to(device)  # [R]: where each row's KV goes
        write_slots = pos % BLOCK_SIZE
        seq_blocks = [blk.to(device) for blk in seq_blocks]
        bounds = [0]
        for p in positions:
            bounds.append(bounds[-1] + len(p))
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [R, D]
        x = self.embed_tokens(torch.tensor(ids, dtype=torch.long, device=device))  # [R, dim]
        for i, layer in enumerate(self.blocks()):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)  # [H, R, D]
            # One indexed copy per tensor: row j -> block write_blocks[j], slot write_slots[j].
            kv.k[i, write_blocks, :, write_slots] = k.transpose(0, 1).to(kv.k.dtype)
            kv.v[i, write_blocks, :, write_slots] = v.transpose(0, 1).to(kv.v.dtype)
            outs = []
            for c, (start, end) in enumerate(itertools.pairwise(bounds)):
                k_all, v_all = _gather_layer(kv, i, seq_blocks[c], ends[c])  # [Hkv, T, D]
                outs.append(attn.attend(q[:, start:end], k_all, v_all, ends[c] - (end - start)))
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = torch.tensor([b - 1 for b in bounds[1:]], device=device)
        logits: Tensor = self.lm_head(self.norm(x[last]))
        return logits

    @torch.inference_mode()
    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               tables: Sequence[Sequence[int]], kv: PagedKV) -> Tensor:
        """One step for a batch: token b sits at positions[b]; returns logits [B, V].

        The list form of `decode_step` (tests, one-off callers); the engine keeps these inputs
        as tensors across steps and calls `decode_step` itself."""
        device = self.device
        n_blocks = max(p // BLOCK_SIZE + 1 for p in positions)
        # Pad each table with its own first block: real, finite KV, masked out below.
        padded = [list(t[: n_blocks]) + [t[0]] * (n_blocks - len(t[: n_blocks])) for t in tables]
        return self.decode_step(torch.tensor(list(tokens), dtype=torch.long, device=device),
                                torch.tensor(list(positions), dtype=torch.long, device=device),
                                torch.tensor(padded, dtype=torch.long, device=device), kv)

    @torch.inference_mode()
    def decode_step(self, ids: Tensor, pos: Tensor, table: Tensor, kv: PagedKV) -> Tensor:
        """One step for a batch, from tensors on the model's device: ids [B] at positions pos
        [B], block tables [B, nb] (nb blocks cover every position; a row's entries past its own
        position are any real blocks, masked out); returns logits [B, V].

        One forward for the whole batch: per layer one indexed write of the B new KV rows, one
        gather of every sequence's KV over the tables and one attention call with a length
        mask. Shapes depend only on (B, nb) and nothing here reads a tensor back to Python, so
        on CUDA the call can be captured in a graph (`kvfleet_runtime.model.DecodeGraphs`)."""
        n_blocks = table.shape[1]
        write_blocks = table.gather(1, (pos // BLOCK_SIZE)[:, None])[:, 0]  # [B]
        write_slots = pos % BLOCK_SIZE
        k_pos = torch.arange(n_blocks * BLOCK_SIZE, device=ids.device)[None, :]  # [1, T]
        visible = k_pos <= pos[:, None]  # [B, T]: the sequence's own tokens, not the padding
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [B, D]
        x = self.embed_tokens(ids)  # [B, dim]
        for i, layer in enumerate(self.blocks()):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)  # [H, B, D]
            kv.k[i, write_blocks, :, write_slots] = k.transpose(0, 1).to(kv.k.dtype)
            kv.v[i, write_blocks, :, write_slots] = v.transpose(0, 1).to(kv.v.dtype)
            k_all = _gather_batch(kv.k[i], table)  # [B, Hkv, T, D]
            v_all = _gather_batch(kv.v[i], table)
            allowed = visible
            if attn.window is not None:
                allowed = allowed & (k_pos > pos[:, None] - attn.window)
            x = x + attn.o_proj(attn.attend_batch(q.transpose(0, 1), k_all, v_all, allowed))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits: Tensor = self.lm_head(self.norm(x))
        return logits


def _gather_layer(kv: PagedKV, layer: int, blocks: Tensor, n_tokens: int
                  ) -> tuple[Tensor, Tensor]:
    # -> k, v: [Hkv, n_tokens, D], gathered from the sequence's blocks by one index_select each
    k = kv.k[layer].index_select(0, blocks)  # [nb, Hkv, 16, D]
    v = kv.v[layer].index_select(0, blocks)
    nb, h, _, d = k.shape
    k = k.transpose(0, 1).reshape(h, nb * BLOCK_SIZE, d)[:, :n_tokens]
    v = v.transpose(0, 1).reshape(h, nb * BLOCK_SIZE, d)[:, :n_tokens]
    return k, v


def _gather_batch(pool: Tensor, table: Tensor) -> Tensor:
    # pool: [num_blocks, Hkv, 16, D]; table: [B, nb] -> [B, Hkv, nb * 16, D]
    b, nb = table.shape
    blocks = pool.index_select(0, table.reshape(-1))  # [B * nb, Hkv, 16, D]
    _, h, _, d = blocks.shape
    return blocks.view(b, nb, h, BLOCK_SIZE, d).transpose(1, 2).reshape(b, h, nb * BLOCK_SIZE, d)
