"""T2 peer transfer, the protocol both sides share: the wire format, the credential, the checksum.

A replica serves the block runs it holds to authenticated peers (`fleet.t2_serve`); a replica
that misses a prefix fetches it from the peer that holds the longest run (`fleet.t2_fetch`).

Protocol (version 3, `VERSION`), one HTTP request per block run:

    POST /kv/v1/blocks
    X-Kvfleet-Tenant: <tenant>
    Authorization: Bearer v2.<expires_s>.<hex HMAC-SHA256(fleet secret, "kvfleet-t2-v2\\0" + tenant
                                 + "\\0" + expires_s)>   (`peer_token`; minutes at most)
    {"key": {CacheKey fields}, "token_ids": [...], "start_block": m, "max_blocks": n,
     "order": "canonical" | "CLBHN" | "LBHNC"}   (optional, default "canonical": `WireOrder`)

The credential is scoped to one tenant and checked in constant time (`hmac.compare_digest`); the
request's `key.tenant_id` must equal that tenant. The server never takes block hashes from the
caller: it recomputes the chain from (key, token_ids), and since the key's tenant is in every
hash, a request for tenant B can only ever reach tenant B's blocks (or allow-listed platform
blocks). No secret configured -> the endpoint refuses everything (fail closed).

Answers: 200 with a run of at least one block; 404 when the server holds no block at or after
`start_block` (a stale hint); 400 bad request; 401 bad credential; 403 tenant mismatch; 503
disabled. The 200 body (octet-stream, HTTP chunked encoding: the server may stop early):

    preamble   b"KVT2" | u8 version = 3 | 3 zero bytes | u32 LE header length
    header     JSON {"start_block", "num_blocks", "block_hashes": [hex], "dtype",
                     "layout": [layers, kv_heads, head_dim], "bytes_per_block", "chunk_blocks",
                     "order"}      (a header without "order" is "canonical": servers before it)
    chunks     for consecutive block ranges of <= chunk_blocks blocks, in order:
               u32 LE n (>= 1) | KV of the n blocks in the header's order (`WireOrder`):
                 canonical  K [layers, kv_heads, n * 16, head_dim] | V (same)
                 CLBHN      K [layers, n, kv_heads, 16, head_dim] | V (same)
                 LBHNC      [layers, n, kv_heads, 16, K|V, head_dim]
               | u64 LE xxh3_64(the KV bytes, seed = index of the chunk's first block in the run)
    end        u32 LE 0

The order is the fetcher's: it asks for the order its memory lies in and the server answers in
it, from where its blocks lie when they lie in that order (the vLLM connector's host pool, kept in
vLLM's per-block order: LBHNC), gathered into it otherwise (a kvfleet replica's cache, whose
engine layout is neither; a connector serving a kvfleet replica, which lands canonical rows). So
every kvfleet replica and every connector fetch from each other, each receiving in its own
order, and no side copies twice. A header in another order than asked (a server that predates
the field answers canonical) is refused before any byte lands: recompute, never wrong data. A
kvfleet replica fetches in its engine's own order (CLBHN: a run of consecutive engine blocks is
one stretch per K|V and layer), straight into the blocks its engine allocated; a server that
predates CLBHN answers 400 to it (counted `http`): recompute, during a rollout only.

Chunks let the server gather block range i + 1 out of its cache into a reused send buffer (and
checksum it, in a worker thread) while range i goes from its buffer straight to the socket
(`loop.sock_sendall` on a duplicate of the connection's socket: one HTTP chunk per range, no
user-space copy; a source whose memory lies in the asked order and cannot change while it
streams, the vLLM connector's referenced host-pool slots, is sent from where it lies, with no
gather), and
let the client keep every verified leading chunk when a peer dies or stops mid-run (the run is
a prefix: still worth its blocks). A block evicted between two chunks ends the
stream early; the run is then shorter, never wrong. The client (`fleet._receive`) receives each
chunk's rows straight into their places in the canonical `[layer][kv_head][token][head_dim]`
buffers (`recvmsg_into` scatter reads, no HTTP-parser or staging copies), or with
`PeerFetcher.fetch_into` into the caller's own memory in the order it asked for (the vLLM
connector's host-pool slots, LBHNC); a worker thread checksums them where they landed while the
next chunk arrives.

The fetcher checks the hashes against the chain it computed itself, the dtype/layout/order
against its own, the size of every chunk, and every chunk's checksum; a chunk that fails ends
the run before it; no verified chunk at all (or a timeout, a refused connection) and the request
recomputes (same output). XXH3-64 (not a cryptographic hash) because peers are authenticated
separately (the bearer credential, compared in constant time): the checksum only guards against
corrupt bytes, at ~15 GB/s here, where zlib's CRC32 (protocol version 2) ran at ~1-2 GB/s and
blake2b at ~0.4 GB/s.

The held probe (the peer-probe hint index, `fleet.probe`, when no Redis is configured), same
credential:

    POST /kv/v1/held
    X-Kvfleet-Tenant: <tenant>
    Authorization: Bearer <same credential as above>
    {"block_hashes": [hex, ...]}            (1..MAX_PROBE_BLOCKS hashes of one chain, in order)
    -> 200 {"leading_blocks": n}            how many leading hashes of that chain are held here

The one route that takes hashes from the caller; it answers only a count, and only blocks stored
for the credential's tenant (or allow-listed platform blocks) count. Every chained hash commits to
its tenant, so a probe of tenant B's chain never matches tenant A's blocks, and even A's exact
hashes presented with B's credential count nothing. 400 with a message for a bad body, 401 and
503 as above.

T2 is torch-free (it moves bytes); `kvfleet_runtime.fleet.t2_source` adapts it to `PrefixCache`
tensors.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvfleet_runtime.cache import BLOCK_SIZE

__all__ = [
    "DEFAULT_PEER_TOKEN_TTL_S",
    "MAGIC",
    "MAX_HASH_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_PEER_TOKEN_TTL_S",
    "MAX_PROBE_BLOCKS",
    "PREAMBLE",
    "U32",
    "U64",
    "VERSION",
    "BufferPool",
    "PeerSecrets",
    "WireOrder",
    "chunk_axes",
    "chunk_checksum",
    "parse_peer_token",
    "peer_token",
    "token_mac",
]

log = logging.getLogger(__name__)

MAX_PROBE_BLOCKS = 4096
"""Most chain hashes one held probe may ask about (a 64k-token prompt)."""


MAX_HASH_BYTES = 64


MAGIC = b"KVT2"


VERSION = 3


PREAMBLE = struct.Struct("<4sB3xI")


U32 = struct.Struct("<I")


U64 = struct.Struct("<Q")


MAX_HEADER_BYTES = 1 << 22


_TOKEN_DOMAIN = b"kvfleet-t2-v2\x00"


class WireOrder(enum.StrEnum):
    """The order of a chunk's KV bytes on the wire (the request's and the header's "order")."""

    CANONICAL = "canonical"
    """`[K|V][layer][kv_head][token][head_dim]`: K rows then V rows, each row one head of one
    layer over the chunk's tokens (the layout of `kvfleet_runtime.cache`'s exports and of a
    kvfleet replica's receive buffers)."""
    CLBHN = "CLBHN"
    """`[K|V][layer][block][kv_head][token][head_dim]`: a kvfleet replica's pools (T0, the
    engine's KV, and T1), K and V each `[layers, blocks, heads, 16, head_dim]` in one
    allocation. A run of consecutive slots is one stretch per (K|V, layer): T2 lands a fetch
    straight in the engine's blocks (`fleet.peer_tier`)."""
    LBHNC = "LBHNC"
    """`[layer][block][kv_head][token][K|V][head_dim]`: per layer, block after block, each as
    vLLM lays a block in its LBHNC layout (K and V of a token adjacent). The vLLM connector's
    host pool: a run of consecutive slots is one stretch per layer, and its copies to and from
    vLLM's layouts move K|V of a token (or more) per inner step."""


def chunk_axes(order: WireOrder, num_blocks: int,
               layout: tuple[int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, permutation) of a chunk of `num_blocks` blocks in `order`: the chunk's bytes
    viewed as `shape` (in elements) and permuted by `permutation` are its KV as
    `[2 (K, V), layers, kv_heads, num_blocks, 16, head_dim]`, whatever the order (numpy's
    `transpose`, torch's `permute`). The one home of each order's shape."""
    layers, heads, head_dim = layout
    if order is WireOrder.CANONICAL:
        return (2, layers, heads, num_blocks, BLOCK_SIZE, head_dim), (0, 1, 2, 3, 4, 5)
    if order is WireOrder.CLBHN:
        return (2, layers, num_blocks, heads, BLOCK_SIZE, head_dim), (0, 1, 3, 2, 4, 5)
    if order is WireOrder.LBHNC:
        return (layers, num_blocks, heads, BLOCK_SIZE, 2, head_dim), (4, 0, 2, 1, 3, 5)
    raise ValueError(f"unknown wire order {order!r}")


DEFAULT_PEER_TOKEN_TTL_S = 60.0
"""A peer credential is minted per request and good for this long: checked once, when a
transfer starts, so a transfer in flight is never dropped by its credential expiring."""


MAX_PEER_TOKEN_TTL_S = 300.0
"""Credentials that claim a longer life are refused (a leaked one is worth minutes at most)."""


def peer_token(secret: bytes, tenant_id: str, *, now_s: float | None = None,
               ttl_s: float = DEFAULT_PEER_TOKEN_TTL_S) -> str:
    """The tenant-scoped bearer credential a peer presents for `tenant_id`, expiring `ttl_s`
    from `now_s` (wall clock): `v2.<expires_s>.<hex HMAC-SHA256(secret, domain | tenant | NUL |
    expires_s)>`."""
    expires = int((time.time() if now_s is None else now_s) + ttl_s)
    return f"v2.{expires}.{token_mac(secret, tenant_id, expires)}"


_EXPIRY_DIGITS = 12
_MAC_HEX = 64


def parse_peer_token(authorization: str | None) -> tuple[int, str] | None:
    """(expires_s, mac) of an `Authorization: Bearer v2.<expires_s>.<mac>` value, or None when it
    is not one. Only ASCII digits and lowercase hex count: `str.isdigit()` alone takes "²" or
    "٣" (which `int()` then refuses, or reads as another number), and header text may hold
    lone surrogates (bytes that are not UTF-8)."""
    if not authorization or not authorization.isascii():
        return None
    scheme, _, presented = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    version, _, rest = presented.strip().partition(".")
    expires, _, mac = rest.partition(".")
    if (version != "v2" or not expires.isdigit() or len(expires) > _EXPIRY_DIGITS
            or len(mac) != _MAC_HEX or mac.strip("0123456789abcdef")):
        return None
    return int(expires), mac


def token_mac(secret: bytes, tenant_id: str, expires: int) -> str:
    message = _TOKEN_DOMAIN + tenant_id.encode("utf-8") + b"\x00" + str(expires).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class PeerSecrets:
    """The fleet's peer secrets, one per line of the secret file: the first signs, every one is
    accepted. A rotation without dropping a transfer: "old, new" everywhere (accept both), then
    "new, old" (sign with the new), then "new" (docs/security.md). `reload` picks up an edited
    file (the fleet tier calls it every config poll)."""

    def __init__(self, secrets: Sequence[bytes], path: Path | None = None) -> None:
        if not secrets or not all(secrets):
            raise ValueError("peer secrets must be non-empty")
        self.accepted = tuple(secrets)
        self.path = path
        self._raw: bytes | None = None

    @property
    def signing(self) -> bytes:
        return self.accepted[0]

    @staticmethod
    def parse(raw: bytes) -> tuple[bytes, ...]:
        return tuple(line.strip() for line in raw.splitlines() if line.strip())

    @classmethod
    def from_file(cls, path: Path) -> PeerSecrets | None:
        """None when the file holds no secret."""
        raw = path.read_bytes()
        secrets = cls.parse(raw)
        if not secrets:
            return None
        out = cls(secrets, path)
        out._raw = raw
        return out

    def reload(self) -> bool:
        """Re-read the file; True when the secrets changed. A missing or empty file keeps the
        secrets in force (a Secret volume update swaps a symlink, never empties the file)."""
        if self.path is None:
            return False
        try:
            raw = self.path.read_bytes()
        except OSError:
            return False
        if raw == self._raw:
            return False
        self._raw = raw
        secrets = self.parse(raw)
        if not secrets or secrets == self.accepted:
            return False
        self.accepted = secrets
        return True


def chunk_checksum(data: memoryview | Sequence[memoryview], first_block: int) -> int:
    """A chunk's integrity checksum: XXH3-64 of its K and V bytes, seeded with the index of its
    first block within the run (so a chunk sent at the wrong place fails too). `data` is the
    chunk, or its pieces in wire order wherever they lie (rows received or sent in place): the
    same checksum either way. It detects corruption, it does not authenticate (peers are
    authenticated by the bearer credential). xxhash releases the GIL over large buffers and runs
    at ~15 GB/s here, against zlib CRC32's ~1-2 GB/s."""
    if isinstance(data, memoryview):
        return xxhash.xxh3_64_intdigest(data, seed=first_block)
    digest = xxhash.xxh3_64(seed=first_block)
    for piece in data:
        digest.update(piece)
    return digest.intdigest()


class BufferPool:
    """Reusable byte buffers, best fit, at most `max_idle` kept. First-touch page faults of fresh
    memory cost more than copying into it (tens of MiB per transfer), so steady-state transfers
    reuse buffers; the pool only bounds what it keeps idle (buffers in use are the callers')."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max_idle
        self._idle: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A buffer of at least `num_bytes` (a reused one when one fits)."""
        with self._lock:
            fits = [i for i, a in enumerate(self._idle) if a.nbytes >= num_bytes]
            if fits:
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].nbytes))
        return np.empty(num_bytes, dtype=np.uint8)

    def give(self, buf: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """Return a buffer nothing references any more; the smallest is dropped when full."""
        with self._lock:
            self._idle.append(buf)
            if len(self._idle) > self.max_idle:
                self._idle.remove(min(self._idle, key=lambda a: a.nbytes))

    def __len__(self) -> int:
        return len(self._idle)
