"""The whole cache key of a vLLM replica: the same `CacheKey` (and so the same chained block
hashes) a kvfleet replica of the same checkpoint files its blocks under.

vLLM's own block hash is `hash(parent, token ids, extra keys)` where the extra keys are the LoRA
name, multimodal hashes, prompt-embeds digests and `cache_salt`: it never names the model, the
weights, the KV dtype, the rotary config or the attention arithmetic, because it only ever lives
inside one engine process. A shared host pool, a peer and a rollout need all of them, so the
connector keys each block with `CacheKey(tenant, model_id, weights_digest, kv_dtype,
rope_config_hash, attn_impl_id)`:

- tenant: the request's `cache_salt`, which the router overwrites with the authenticated
  tenant's signed salt `<tenant>.<mac>` (`kvfleet_runtime.auth.cache_salt`); with the salt secret
  configured (`kvfleet.salt_secret_file`) a salt that does not verify names no tenant and the
  request bypasses the connector (`TenantSalts`);
- weights_digest: sha256 of the checkpoint's safetensors files, as kvfleet's loader computes it;
- kv_dtype, rope_config_hash: from the checkpoint's config.json through kvfleet's own parser;
- attn_impl_id: kvfleet's id with the attention arithmetic named `vllm-<backend>`: vLLM's
  kernels do not produce bit-identical KV to kvfleet's reference model, so the two engines share
  the key construction, the hint index and peers, never each other's blocks.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_runtime.auth import SaltRefused, verify_cache_salt
from kvfleet_runtime.cache import PLATFORM_TENANT, CacheKey, key_digest
from kvfleet_runtime.model.architectures import parse_hf_config
from kvfleet_runtime.model.checkpoint import read_config, weights_digest
from kvfleet_vllm._options import PREFIX

__all__ = ["SUPPORTED_KV_DTYPES", "ModelKey", "TenantSalts", "model_key", "tenant_of"]

log = logging.getLogger(__name__)

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
    """The tenant of a request without a salt secret: its `cache_salt` as it is, or the
    deployment's default tenant (a deployment whose clients are trusted to name themselves)."""
    tenant = default_tenant if cache_salt is None else cache_salt
    if not tenant or tenant == PLATFORM_TENANT:
        raise ValueError(f"cache_salt {cache_salt!r} cannot name a tenant "
                         f"(empty, or the reserved {PLATFORM_TENANT!r})")
    return tenant


_REMEMBERED_REFUSALS = 4096
"""Request ids whose refusal was counted: vLLM asks about a waiting request again every step,
and one request must count (and log) once."""


@dataclass(slots=True)
class TenantSalts:
    """A request's tenant from its `cache_salt`.

    With a `secret` (the router's, `kvfleet.salt_secret_file`) only a salt the router minted
    names a tenant: a missing, malformed or forged one is a `SaltRefused`, the request bypasses
    the connector (no load, no store: vLLM computes it, isolated by its own salted hash) and the
    refusal is counted by reason in `num_refused` and logged once per request. It is never
    filed under another tenant, the default tenant included. Without a secret the salt is the
    tenant as it is (`tenant_of`)."""

    default_tenant: str = "default"
    secret: bytes | None = None
    num_refused: Counter[str] = field(default_factory=Counter)
    _counted: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _new_refusals: Counter[str] = field(default_factory=Counter)

    @classmethod
    def load(cls, default_tenant: str, secret_file: Path | None) -> TenantSalts:
        """With the router secret read from `secret_file` (None: salts are tenant names); raises
        ValueError naming an unreadable or empty file (the connector refuses to start rather
        than trust every salt)."""
        if secret_file is None:
            return cls(default_tenant)
        try:
            secret = secret_file.read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"{PREFIX}salt_secret_file={secret_file}: "
                             f"{exc.strerror or exc}") from exc
        if not secret:
            raise ValueError(f"{PREFIX}salt_secret_file={secret_file} is empty")
        return cls(default_tenant, secret)

    def tenant(self, request_id: str, cache_salt: str | None) -> str | SaltRefused:
        """The request's tenant, or why it has none (counted once per request id)."""
        if self.secret is None:
            try:
                return tenant_of(cache_salt, self.default_tenant)
            except ValueError as exc:
                return self._refuse(request_id, SaltRefused("malformed", str(exc)))
        verified = verify_cache_salt(self.secret, cache_salt)
        if isinstance(verified, SaltRefused):
            return self._refuse(request_id, verified)
        if verified == PLATFORM_TENANT:
            return self._refuse(request_id, SaltRefused(
                "malformed", f"cache_salt names the reserved tenant {PLATFORM_TENANT!r}"))
        return verified

    def take_refusals(self) -> dict[str, int]:
        """Refused requests by reason since the last call (shipped with the connector's stats,
        exported as `kvfleet_vllm_salt_refused_requests_total{reason}`)."""
        new, self._new_refusals = dict(self._new_refusals), Counter()
        return new

    def _refuse(self, request_id: str, refused: SaltRefused) -> SaltRefused:
        if request_id not in self._counted:
            self._counted[request_id] = None
            if len(self._counted) > _REMEMBERED_REFUSALS:
                self._counted.popitem(last=False)
            self.num_refused[refused.reason] += 1
            self._new_refusals[refused.reason] += 1
            log.warning("kvfleet connector bypasses request %s (cache_salt %s): %s",
                        request_id, refused.reason, refused.message)
        return refused
