"""The whole cache key of a vLLM replica: the same `CacheKey` (and so the same chained block
hashes) a kvfleet replica of the same checkpoint files its blocks under.

vLLM's own block hash is `hash(parent, token ids, extra keys)` where the extra keys are the LoRA
name, multimodal hashes, prompt-embeds digests and `cache_salt`: it never names the model, the
weights, the KV dtype, the rotary config or the attention arithmetic, because it only ever lives
inside one engine process. A shared host pool, a peer and a rollout need all of them, so the
connector keys each block with `CacheKey(tenant, model_id, weights_digest, kv_dtype,
rope_config_hash, attn_impl_id)`:

- tenant: the request's `cache_salt` (the router sets it from the authenticated tenant);
- weights_digest: sha256 of the checkpoint's safetensors files, as kvfleet's loader computes it;
- kv_dtype, rope_config_hash: from the checkpoint's config.json through kvfleet's own parser;
- attn_impl_id: kvfleet's id with the attention arithmetic named `vllm-<backend>`: vLLM's
  kernels do not produce bit-identical KV to kvfleet's reference model, so the two engines share
  the key construction, the hint index and peers, never each other's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfleet_runtime.architectures import parse_hf_config
from kvfleet_runtime.cache import PLATFORM_TENANT, CacheKey, key_digest
from kvfleet_runtime.model.checkpoint import read_config, weights_digest

__all__ = ["SUPPORTED_KV_DTYPES", "ModelKey", "model_key", "tenant_of"]

SUPPORTED_KV_DTYPES = ("float16", "bfloat16", "float32")
"""KV dtypes copied exactly. FP8 KV carries per-tensor scales the canonical layout does not
hold, so an FP8 cache is refused rather than stored without them."""


@dataclass(slots=True, frozen=True)
class ModelKey:
    """The model half of the key; `key(tenant)` completes it per request."""

    model_id: str
    weights_digest: str
    kv_dtype: str
    rope_config_hash: str
    attn_impl_id: str

    def key(self, tenant_id: str) -> CacheKey:
        return CacheKey(tenant_id, self.model_id, self.weights_digest, self.kv_dtype,
                        self.rope_config_hash, self.attn_impl_id)


def model_key(model_dir: Path, *, model_id: str, kv_dtype: str, attention_backend: str,
              digest: str | None = None) -> ModelKey:
    """The key fields of the checkpoint in `model_dir` served by vLLM with `attention_backend`.

    `digest` skips hashing the weights when the deployment already knows it (the operator
    publishes it with the rollout); it must be a content digest, never a tag."""
    if kv_dtype not in SUPPORTED_KV_DTYPES:
        raise ValueError(f"kv dtype {kv_dtype!r} is not supported by the kvfleet connector; "
                         f"supported: {', '.join(SUPPORTED_KV_DTYPES)}")
    if not attention_backend or not attention_backend.replace("_", "").isalnum():
        raise ValueError(f"attention backend must be a plain name, got {attention_backend!r}")
    args = parse_hf_config(read_config(Path(model_dir)), dtype=kv_dtype)
    kvfleet_id = args.attn_impl_id()
    # kvfleet's id is "<impl>-chunk16-v1-<hash of what else the KV depends on>": keep the hash,
    # name vLLM's arithmetic instead of kvfleet's.
    attn_impl_id = f"vllm-{attention_backend.lower()}" + kvfleet_id[len(args.attn_impl):]
    fields = ModelKey(model_id, digest or weights_digest(Path(model_dir)), args.dtype,
                      args.rope_config_hash(), attn_impl_id)
    key_digest(fields.key("probe"))  # validates every field now, not at the first request
    return fields


def tenant_of(cache_salt: str | None, default_tenant: str) -> str:
    """The tenant of a request: its `cache_salt`, or the deployment's default tenant."""
    tenant = default_tenant if cache_salt is None else cache_salt
    if not tenant or tenant == PLATFORM_TENANT:
        raise ValueError(f"cache_salt {cache_salt!r} cannot name a tenant "
                         f"(empty, or the reserved {PLATFORM_TENANT!r})")
    return tenant
