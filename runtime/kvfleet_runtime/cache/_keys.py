"""Cache keys and chained block hashes: the identity of every cached block.

A block's hash commits to the whole `CacheKey` and to every token before it, so two sequences that
diverge at block 3 can never share block 4, and changing any key field (a new weights digest, an
FP8 KV dtype, another RoPE config) changes every hash: a rollout needs no invalidation sweep.

Hash construction (version 1; the fixed vectors in the tests pin it):

    key_digest = blake2b-128(person="kvfleet-key-v1", len-prefixed UTF-8 of the 6 key fields)
    h[0]       = blake2b-128(person="kvfleet-blk-v1", key_digest || tokens[0:16], uint32 LE)
    h[i]       = blake2b-128(person="kvfleet-blk-v1", h[i-1] || tokens[16i:16i+16], uint32 LE)

A platform-owned prefix (an explicit allow-list) is hashed under the platform tenant; the first
tenant block after it chains from `blake2b-128(person="kvfleet-scope-v1", tenant key_digest ||
h[p-1])`, so the platform blocks are shared across tenants and nothing after them is.
Python's `hash()` is never used: it is salted per process (PYTHONHASHSEED).
"""

from __future__ import annotations

import array
import functools
import hashlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, NewType, cast

from kvfleet_runtime.wire import BLOCK_SIZE, PLATFORM_TENANT

__all__ = [
    "BLOCK_SIZE",
    "PLATFORM_TENANT",
    "BlockHash",
    "CacheKey",
    "ChainMemo",
    "PromptChain",
    "block_hashes",
    "continue_chain",
    "iter_block_hashes",
    "key_digest",
    "platform_key",
    "token_bytes",
    "usable_tokens",
]


HASH_BYTES = 16
"""128-bit digests: collision resistance of 2^64 work, far beyond any cache's lifetime."""


BlockHash = NewType("BlockHash", bytes)

_KEY_PERSON = b"kvfleet-key-v1"
_BLOCK_PERSON = b"kvfleet-blk-v1"
_SCOPE_PERSON = b"kvfleet-scope-v1"
_BLOCK_PROTO = hashlib.blake2b(digest_size=HASH_BYTES, person=_BLOCK_PERSON)
_DIGEST_RE = re.compile(r"^(sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128}|blake2b:[0-9a-f]{32,128})$")
_BLOCK_BYTES = BLOCK_SIZE * 4


class CacheKey(NamedTuple):
    """Everything prefill output depends on besides the tokens. TP degree is deliberately absent:
    KV is stored in a TP-agnostic layout and sharded on materialization."""

    tenant_id: str
    model_id: str
    weights_digest: str
    """A content digest such as "sha256:<64 hex>"; a tag ("latest", "v2") is rejected."""
    kv_dtype: str
    rope_config_hash: str
    attn_impl_id: str


def usable_tokens(num_prompt_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """The leading whole blocks of a prompt, in tokens, that any cache tier may supply: the
    engine always computes the last prompt token itself (its logits give the first output
    token), so a block that ends on it is never a hit. `block_size`: the engine's block (vLLM's
    may be a multiple of the cache's)."""
    return max(0, (num_prompt_tokens - 1) // block_size * block_size)


def validate_weights_digest(weights_digest: str) -> str:
    if not isinstance(weights_digest, str) or not _DIGEST_RE.match(weights_digest):
        raise ValueError(
            f"weights_digest must be a content digest like 'sha256:<64 hex>', "
            f"not a tag: {weights_digest!r}"
        )
    return weights_digest


@functools.lru_cache(maxsize=4096)
def key_digest(key: CacheKey) -> bytes:
    """The 16-byte digest every chain starts from. Validates the key once per distinct key."""
    if not isinstance(key, CacheKey):
        raise ValueError(f"expected a CacheKey, got {type(key).__name__}: {key!r}")
    for name, value in zip(CacheKey._fields, key, strict=True):
        if not isinstance(value, str) or not value:
            raise ValueError(f"CacheKey.{name} must be a non-empty string, got {value!r}")
    validate_weights_digest(key.weights_digest)
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=_KEY_PERSON)
    for value in key:
        raw = value.encode("utf-8")
        # Length prefixes make the encoding injective: ("ab","c") and ("a","bc") differ.
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


def platform_key(key: CacheKey) -> CacheKey:
    """The same key with the platform tenant: used for allow-listed platform prefixes only."""
    return key._replace(tenant_id=PLATFORM_TENANT)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian, the stable byte form that is hashed."""
    try:
        raw = array.array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        bad = next(
            (t for t in token_ids if not isinstance(t, int) or not 0 <= t < 2**32), token_ids
        )
        raise ValueError(f"token ids must be integers in [0, 2**32), got {bad!r}") from exc
    if raw.itemsize != 4:  # pragma: no cover - every supported platform has a 4-byte 'I'
        raise AssertionError("array('I') is not 32-bit on this platform")
    if sys.byteorder == "big":  # pragma: no cover - hashes must not depend on the machine
        raw.byteswap()
    return raw.tobytes()


def _scope_seed(tenant_digest: bytes, platform_tail: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=_SCOPE_PERSON)
    h.update(tenant_digest + platform_tail)
    return h.digest()


class ChainMemo:
    """Remembers the chain steps of prefixes that lookups hit, so that a hot prefix is hashed
    once, not at every request.

    A replica looks up the same system prompts and documents again and again, and per-block
    hashing is most of a lookup's cost. The memo maps the exact bytes a step hashes (`prev ||
    chunk`, 80 bytes) to its digest: bytes equality decides a hit, so a memo hit returns what
    hashing would, never a near miss.

    Only lookups add steps (`remember=True`): a lookup computes the steps of the blocks the index
    holds plus one, so one-shot prompts never fill the memo, and the store after every prefill,
    the fleet tier and peer imports only read it. Bounded to `max_entries` steps (about 200 B
    each) in two generations: a step found in the old generation moves to the young one, and
    when the young one holds `max_entries // 2` steps the old one is dropped. No lock: concurrent
    chains may lose each other's inserts, never corrupt a value."""

    __slots__ = ("_half", "_old", "_young", "num_hits", "num_misses")

    def __init__(self, max_entries: int) -> None:
        if not isinstance(max_entries, int) or max_entries < 2:
            raise ValueError(f"ChainMemo max_entries must be an int >= 2, got {max_entries!r}")
        self._half = max_entries // 2
        self._young: dict[bytes, bytes] = {}
        self._old: dict[bytes, bytes] = {}
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def clear(self) -> None:
        self._young = {}
        self._old = {}

    def chain(
        self, prev: bytes, data: bytes, start: int, stop: int, *, remember: bool
    ) -> Iterator[bytes]:
        """The hashes of the blocks `data[start:stop]` (whole blocks) chained onto `prev`; with
        `remember`, the steps not already in the young generation are put there."""
        young, old = self._young, self._old
        copy = _BLOCK_PROTO.copy
        misses = 0
        i = j = start - _BLOCK_BYTES  # the last step taken: i, then j past the first miss
        try:
            for i in range(start, stop, _BLOCK_BYTES):
                link = prev + data[i : i + _BLOCK_BYTES]
                digest = young.get(link)
                if digest is None:
                    digest = old.get(link)
                    if digest is None:
                        misses += 1
                        h = copy()
                        h.update(link)
                        digest = h.digest()
                        if not remember:
                            # Only lookups fill the memo, each from a chain's first block on,
                            # so past a chain's first miss its steps are all but never there:
                            # a store (every miss's) hashes the rest as `_plain_chain` does,
                            # without the probes and the step's bytes a block.
                            yield digest
                            for j in range(i + _BLOCK_BYTES, stop, _BLOCK_BYTES):
                                misses += 1
                                h = copy()
                                h.update(digest)
                                h.update(data[j : j + _BLOCK_BYTES])
                                digest = h.digest()
                                yield digest
                            return
                    if remember:
                        if len(young) >= self._half:
                            self._old = old = young
                            self._young = young = {}
                        young[link] = digest
                prev = digest
                yield digest
        finally:  # also when a lookup stops at its first miss and drops the chain
            steps = (max(i, j) - start) // _BLOCK_BYTES + 1
            self.num_hits += steps - misses
            self.num_misses += misses


def iter_block_hashes(
    key: CacheKey,
    token_ids: Sequence[int],
    *,
    platform_blocks: int = 0,
    memo: ChainMemo | None = None,
    remember: bool = False,
) -> Iterator[BlockHash]:
    """Lazily yield the chained hashes of the full blocks of `token_ids`.

    Lazy so that a lookup stops hashing at its first miss. The first `platform_blocks` blocks are
    hashed under the platform tenant (the caller has checked them against the allow-list). With a
    `memo`, steps it holds are looked up instead of hashed; with `remember` (lookups), the steps
    taken are added to it.
    """
    data = token_bytes(token_ids)
    num_blocks = len(data) // _BLOCK_BYTES
    if not 0 <= platform_blocks <= num_blocks:
        raise ValueError(f"platform_blocks must be in [0, {num_blocks}], got {platform_blocks}")
    chain = _plain_chain if memo is None else functools.partial(memo.chain, remember=remember)
    end = num_blocks * _BLOCK_BYTES
    if platform_blocks == 0:
        hashes = chain(key_digest(key), data, 0, end)
    else:
        hashes = _scoped_hashes(key, data, platform_blocks * _BLOCK_BYTES, end, chain)
    # BlockHash is a NewType of bytes: one cast here, not a call per block on the lookup path.
    return cast(Iterator[BlockHash], hashes)


class PromptChain:
    """The chained hashes of one prompt's full blocks, each computed at most once per request.

    A request's lookup walks the chain from its first block and stops at its first miss
    (`walk`, lazily); the tiers below the cache, the prompt's store and the peers then need more
    of the same chain (`upto`), which continues from the last hash computed instead of hashing
    the prompt again. Only the walk adds steps to the memo (what a lookup takes: the blocks the
    index holds, plus one); the rest reads it, as every non-lookup chain does. Not thread-safe:
    one request's thread uses it (hashing itself takes no lock)."""

    __slots__ = ("_data", "_memo", "hashes", "key", "num_blocks", "platform_blocks")

    def __init__(
        self,
        key: CacheKey,
        token_ids: Sequence[int],
        *,
        platform_blocks: int = 0,
        memo: ChainMemo | None = None,
    ) -> None:
        self.key = key
        self._data = token_bytes(token_ids)
        self.num_blocks = len(self._data) // _BLOCK_BYTES
        """Full blocks of the prompt: the chain's length."""
        if not 0 <= platform_blocks <= self.num_blocks:
            raise ValueError(
                f"platform_blocks must be in [0, {self.num_blocks}], got {platform_blocks}"
            )
        self.platform_blocks = platform_blocks
        self._memo = memo
        self.hashes: list[BlockHash] = []
        """The hashes computed so far, from the first block on."""

    @property
    def num_usable(self) -> int:
        """Blocks any tier may supply (`usable_tokens`: never the last prompt token's)."""
        return usable_tokens(len(self._data) // 4) // BLOCK_SIZE

    def walk(self) -> Iterator[BlockHash]:
        """The chain from its first block, for a lookup: computed (and remembered) as far as it
        is iterated; what is known already is yielded as it is."""
        yield from self.hashes
        if len(self.hashes) == self.num_blocks:
            return
        for h in self._resume(len(self.hashes), self.num_blocks, remember=True):
            self.hashes.append(h)
            yield h

    def upto(self, num_blocks: int) -> list[BlockHash]:
        """The first `num_blocks` hashes (at most the chain's length), computing the missing
        ones from the last one known."""
        n = min(num_blocks, self.num_blocks)
        if len(self.hashes) < n:
            self.hashes.extend(self._resume(len(self.hashes), n, remember=False))
        return self.hashes[:n]

    def _resume(self, start: int, stop: int, *, remember: bool) -> Iterator[BlockHash]:
        """Hashes of blocks [start, stop), chained onto block start - 1 (known)."""
        memo = self._memo
        chain = _plain_chain if memo is None else functools.partial(memo.chain, remember=remember)
        data, split, key = self._data, self.platform_blocks, self.key
        lo, hi = start * _BLOCK_BYTES, stop * _BLOCK_BYTES
        prev: bytes = self.hashes[start - 1] if start else b""
        if not split:
            hashes = chain(prev if start else key_digest(key), data, lo, hi)
        elif start < split:
            tail = prev if start else key_digest(platform_key(key))
            hashes = _scoped_hashes_from(key, data, tail, lo, split * _BLOCK_BYTES, hi, chain)
        else:  # past the platform prefix: the tenant's chain, seeded at the split
            seed = _scope_seed(key_digest(key), prev) if start == split else prev
            hashes = chain(seed, data, lo, hi)
        return cast(Iterator[BlockHash], hashes)


def _scoped_hashes_from(
    key: CacheKey,
    data: bytes,
    tail: bytes,
    lo: int,
    split: int,
    hi: int,
    chain: Callable[[bytes, bytes, int, int], Iterator[bytes]],
) -> Iterator[bytes]:
    """`_scoped_hashes` from byte `lo` of the platform part on, `tail` the hash before it."""
    for block_hash in chain(tail, data, lo, min(split, hi)):
        yield block_hash
        tail = block_hash
    if hi > split:
        yield from chain(_scope_seed(key_digest(key), tail), data, split, hi)


def _plain_chain(prev: bytes, data: bytes, start: int, stop: int) -> Iterator[bytes]:
    copy = _BLOCK_PROTO.copy
    for i in range(start, stop, _BLOCK_BYTES):
        h = copy()
        h.update(prev)  # two updates hash what one of `prev + chunk` would, without the join
        h.update(data[i : i + _BLOCK_BYTES])
        prev = h.digest()
        yield prev


def _scoped_hashes(
    key: CacheKey,
    data: bytes,
    split: int,
    end: int,
    chain: Callable[[bytes, bytes, int, int], Iterator[bytes]],
) -> Iterator[bytes]:
    tail = key_digest(platform_key(key))
    for block_hash in chain(tail, data, 0, split):
        yield block_hash
        tail = block_hash
    yield from chain(_scope_seed(key_digest(key), tail), data, split, end)


def continue_chain(prev: bytes, token_ids: Sequence[int]) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` chained onto `prev` (a block hash, or
    `key_digest(key)` for a chain's first block): `block_hashes(key, a + b)` equals
    `block_hashes(key, a) + continue_chain(block_hashes(key, a)[-1], b)` for whole-block `a`."""
    data = token_bytes(token_ids)
    end = len(data) // _BLOCK_BYTES * _BLOCK_BYTES
    return cast(list[BlockHash], list(_plain_chain(prev, data, 0, end)))


def block_hashes(
    key: CacheKey, token_ids: Sequence[int], *, platform_blocks: int = 0
) -> list[BlockHash]:
    """The chained hashes of every full 16-token block of `token_ids` (a partial tail is not
    hashed: only full blocks are cached)."""
    return list(iter_block_hashes(key, token_ids, platform_blocks=platform_blocks))
