"""T2 peer transfer: a replica serves the block runs it holds to authenticated peers.

Protocol (version 1), one HTTP request per block run:

    POST /kv/v1/blocks
    X-Kvfleet-Tenant: <tenant>
    Authorization: Bearer v2.<expires_s>.<hex HMAC-SHA256(fleet secret, "kvfleet-t2-v2\\0" + tenant
                                 + "\\0" + expires_s)>   (`peer_token`; minutes at most)
    {"key": {CacheKey fields}, "token_ids": [...], "start_block": m, "max_blocks": n}

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
                     "layout": [layers, kv_heads, head_dim], "bytes_per_block", "chunk_blocks"}
    chunks     for consecutive block ranges of <= chunk_blocks blocks, in order:
               u32 LE n (>= 1) | K [layers, kv_heads, n * 16, head_dim] | V (same)
               | u64 LE xxh3_64(K || V, seed = index of the chunk's first block in the run)
    end        u32 LE 0

Chunks let the server gather block range i + 1 out of its cache into a reused send buffer (and
checksum it, in a worker thread) while range i goes from its buffer straight to the socket
(`loop.sock_sendall` on a duplicate of the connection's socket: one HTTP chunk per range, no
user-space copy), and let the client keep every verified leading chunk when a peer dies or stops
mid-run (the run is a prefix: still worth its blocks). A block evicted between two chunks ends the
stream early; the run is then shorter, never wrong. The client (`fleet._receive`) receives each
chunk's rows straight into their places in the canonical `[layer][kv_head][token][head_dim]`
buffers (`recvmsg_into` scatter reads, no HTTP-parser or staging copies); a worker thread
checksums them while the next chunk arrives.

The fetcher checks the hashes against the chain it computed itself, the dtype/layout against its
own, the size of every chunk, and every chunk's checksum; a chunk that fails ends the run before
it; no verified chunk at all (or a timeout, a refused connection) and the request recomputes (same
output). XXH3-64 (not a cryptographic hash) because peers are authenticated separately (the bearer
credential, compared in constant time): the checksum only guards against corrupt bytes, at ~15
GB/s here, where zlib's CRC32 (protocol version 2) ran at ~1-2 GB/s and blake2b at ~0.4 GB/s.

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

This module is torch-free (it moves bytes); `kvfleet_runtime.fleet.replica` adapts it to
`PrefixCache` tensors.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import numpy as np
import xxhash
from aiohttp import web

from kvfleet_runtime.api import ApiError, error_response, parse_json, read_body
from kvfleet_runtime.auth import MAX_CLOCK_SKEW_S
from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey
from kvfleet_runtime.fleet._receive import BodyReader, post
from kvfleet_runtime.fleet.index import HintIndex, best_peer
from kvfleet_runtime.wire import HELD_PATH, T2_PATH, TENANT_HEADER

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PEER_BODY_BYTES",
    "DEFAULT_PEER_BODY_TIMEOUT_S",
    "DEFAULT_PEER_TOKEN_TTL_S",
    "MAX_PEER_TOKEN_TTL_S",
    "MAX_PROBE_BLOCKS",
    "BlockSource",
    "BufferPool",
    "ExportedRun",
    "FetchStats",
    "FetchedRun",
    "PeerFetcher",
    "PeerSecrets",
    "chunk_checksum",
    "peer_routes",
    "peer_token",
]

log = logging.getLogger(__name__)

MAX_PROBE_BLOCKS = 4096
"""Most chain hashes one held probe may ask about (a 64k-token prompt)."""
MAX_HASH_BYTES = 64
MAGIC = b"KVT2"
VERSION = 3
_PREAMBLE = struct.Struct("<4sB3xI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
DEFAULT_CHUNK_BYTES = 16 << 20
"""Target K+V bytes per chunk (at least one block)."""
_SEND_PIECE = 4 << 20
"""Without a direct socket (TLS): bytes handed to the transport per write; asyncio (3.11) copies
whatever the socket cannot take at once."""
MAX_IDLE_SEND_BUFFERS = 4
"""Send buffers kept for reuse (two per stream: one on the wire, one being gathered)."""
MAX_HEADER_BYTES = 1 << 22
DEFAULT_PEER_BODY_BYTES = 16 << 20
"""Largest request body on the peer routes: a block request for `max_tokens` (2**20) ids is
~11 MB of JSON, a full held probe ~0.3 MB."""
DEFAULT_PEER_BODY_TIMEOUT_S = 10.0
"""A peer's request body must arrive within this (408 after): the OpenAI routes' bound. A peer
announcing 1,000 bytes and sending 8 would otherwise hold the connection for as long as it likes;
peers sit on the cluster network, where 16 MiB takes well under a second."""
_TOKEN_DOMAIN = b"kvfleet-t2-v2\x00"
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
    return f"v2.{expires}.{_token_mac(secret, tenant_id, expires)}"


def _token_mac(secret: bytes, tenant_id: str, expires: int) -> str:
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


def chunk_checksum(data: memoryview, first_block: int) -> int:
    """A chunk's integrity checksum: XXH3-64 of its K and V bytes, seeded with the index of its
    first block within the run (so a chunk sent at the wrong place fails too). It detects
    corruption, it does not authenticate (peers are authenticated by the bearer credential).
    xxhash releases the GIL over large buffers and runs at ~15 GB/s here, against zlib CRC32's
    ~1-2 GB/s."""
    return xxhash.xxh3_64_intdigest(data, seed=first_block)


@dataclass(slots=True)
class ExportedRun:
    """A run of held blocks, read chunk by chunk while it streams."""

    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    layout: tuple[int, int, int]
    """(num_layers, num_kv_heads, head_dim)."""
    bytes_per_block: int
    """K and V of one block."""
    read: Callable[[Sequence[bytes], memoryview, memoryview], bool]
    """Blocking (run in a worker thread): `read(hashes, out_k, out_v)` writes the K and V bytes
    `[layers, kv_heads, n * 16, head_dim]` of consecutive hashes of the run into `out_k` and
    `out_v` (exactly that many bytes each, reused send buffers); False when one is no longer
    held."""
    release: Callable[[], None] = lambda: None
    """Called once when the stream ends (e.g. to drop refs held while reading)."""


class BlockSource(Protocol):
    async def export(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> ExportedRun | None:
        """Longest held run of blocks of (key, token_ids) from `start_block`, at most
        `max_blocks`; None when block `start_block` is not held."""


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


# -- server ---------------------------------------------------------------------------------


_ERROR_CODES = {400: "invalid_value", 401: "invalid_peer_credential", 403: "wrong_tenant",
                404: "not_held", 503: "unavailable"}


def _error(status: int, message: str) -> web.Response:
    """The replica's error envelope (peer routes share the replica's app and its clients)."""
    return error_response(status, message, code=_ERROR_CODES.get(status))


async def _body(request: web.Request, limit_bytes: int, timeout_s: float) -> Any:
    """The JSON body within the shared bounds (size, time, encoding; numbers, depth, Unicode):
    an `ApiError` (400, 408, 413) otherwise."""
    return parse_json(await read_body(request, limit_bytes, timeout_s))


def _refusal(exc: ApiError) -> web.Response:
    return error_response(exc.status, exc.message, code=exc.code, headers=exc.headers)


def _parse_request(body: Any, max_tokens: int) -> tuple[CacheKey, list[int], int, int]:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    raw_key = body.get("key")
    if not isinstance(raw_key, dict) or set(raw_key) != set(CacheKey._fields):
        raise ValueError(f"key must have exactly the fields {list(CacheKey._fields)}")
    if not all(isinstance(raw_key[f], str) and raw_key[f] for f in CacheKey._fields):
        raise ValueError("key fields must be non-empty strings")
    key = CacheKey(**{f: raw_key[f] for f in CacheKey._fields})
    token_ids = body.get("token_ids")
    if (
        not isinstance(token_ids, list)
        or not 0 < len(token_ids) <= max_tokens
        or not all(type(t) is int and 0 <= t < 2**32 for t in token_ids)
    ):
        raise ValueError(f"token_ids must be 1..{max_tokens} integers in [0, 2**32)")
    start_block, max_blocks = body.get("start_block", 0), body.get("max_blocks")
    num_blocks = len(token_ids) // BLOCK_SIZE
    if type(start_block) is not int or not 0 <= start_block < num_blocks:
        raise ValueError(f"start_block must be in [0, {num_blocks}), got {start_block!r}")
    if max_blocks is None:
        max_blocks = num_blocks - start_block
    if type(max_blocks) is not int or max_blocks < 1:
        raise ValueError(f"max_blocks must be a positive integer, got {max_blocks!r}")
    return key, token_ids, start_block, max_blocks


def peer_routes(
    source: BlockSource,
    secret: bytes | PeerSecrets | None,
    *,
    max_tokens: int = 1 << 20,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_served: Callable[[int], None] | None = None,
    buffers: BufferPool | None = None,
    held: Callable[[Sequence[bytes], str], int] | None = None,
    max_body_bytes: int = DEFAULT_PEER_BODY_BYTES,
    body_timeout_s: float = DEFAULT_PEER_BODY_TIMEOUT_S,
) -> list[web.RouteDef]:
    """The T2 endpoint and the held probe for an aiohttp app:
    `app.add_routes(peer_routes(source, secret, held=...))`.

    `held(hashes, tenant)` answers the probe: how many leading hashes of the chain are held here
    for `tenant` (or the platform); None -> the probe answers 503. `secret=None` (or empty) keeps
    the routes but refuses every request. `on_served(bytes)` is called after each complete
    transfer (for metrics). Send buffers come from `buffers` (by default a pool keeping
    `MAX_IDLE_SEND_BUFFERS`). A request body over `max_body_bytes`, or not received within
    `body_timeout_s`, is refused (413, 408) like the OpenAI routes' bodies."""
    pool = BufferPool(MAX_IDLE_SEND_BUFFERS) if buffers is None else buffers

    async def handle(request: web.Request) -> web.StreamResponse:
        tenant = _authenticate(request, secret)
        if isinstance(tenant, web.Response):
            return tenant
        try:
            key, token_ids, start_block, max_blocks = _parse_request(
                await _body(request, max_body_bytes, body_timeout_s), max_tokens
            )
        except ApiError as exc:
            return _refusal(exc)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        if key.tenant_id != tenant:
            return _error(403, f"credential is for tenant {tenant!r}, key is for another tenant")
        try:
            run = await source.export(key, token_ids, start_block, max_blocks)
        except ValueError as exc:  # a key the cache refuses (e.g. a tag instead of a digest)
            return _error(400, str(exc))
        if run is None or not run.block_hashes:
            return _error(404, f"no block held at or after block {start_block}")
        return await _stream_run(request, run, chunk_bytes, on_served, pool)

    async def handle_held(request: web.Request) -> web.StreamResponse:
        tenant = _authenticate(request, secret)
        if isinstance(tenant, web.Response):
            return tenant
        if held is None:
            return _error(503, "this replica does not answer held probes")
        try:
            hashes = _parse_held(await _body(request, max_body_bytes, body_timeout_s))
        except ApiError as exc:
            return _refusal(exc)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        return web.json_response({"leading_blocks": held(hashes, tenant)})

    return [web.post(T2_PATH, handle), web.post(HELD_PATH, handle_held)]


def _authenticate(request: web.Request,
                  secret: bytes | PeerSecrets | None) -> str | web.Response:
    """The tenant the request's credential is for, or the error response to send."""
    if not secret:
        return _error(503, "peer transfer is disabled: no fleet secret configured")
    accepted = secret.accepted if isinstance(secret, PeerSecrets) else (secret,)
    tenant = request.headers.get(TENANT_HEADER, "")
    presented = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    version, _, rest = presented.partition(".")
    expires_text, _, mac = rest.partition(".")
    now = time.time()
    if (not tenant or version != "v2" or not expires_text.isdigit() or len(expires_text) > 12
            or not mac.isascii() or not _encodable(tenant)):
        # (aiohttp hands undecodable header bytes on as surrogates: never encode those)
        return _error(401, "peer credential missing or invalid")
    expires = int(expires_text)
    if not now - MAX_CLOCK_SKEW_S <= expires <= now + MAX_PEER_TOKEN_TTL_S + MAX_CLOCK_SKEW_S:
        return _error(401, "peer credential expired (or claims too long a life)")
    # compare_digest over the ASCII bytes: constant time in the presented value; every accepted
    # secret is tried, so which one matched (a rotation's old or new) does not show in the time.
    matched = False
    for key in accepted:
        matched |= hmac.compare_digest(mac.encode(), _token_mac(key, tenant, expires).encode())
    if not matched:
        return _error(401, "peer credential missing or invalid")
    return tenant


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_held(body: Any) -> list[bytes]:
    if not isinstance(body, dict) or set(body) != {"block_hashes"}:
        raise ValueError('body must be a JSON object {"block_hashes": [hex, ...]}')
    raw = body["block_hashes"]
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_PROBE_BLOCKS:
        raise ValueError(f"block_hashes must be a list of 1..{MAX_PROBE_BLOCKS} hex strings")
    try:
        hashes = [bytes.fromhex(h) for h in raw if isinstance(h, str)]
    except ValueError:
        raise ValueError("block_hashes must be hex strings") from None
    if len(hashes) != len(raw) or not all(0 < len(h) <= MAX_HASH_BYTES for h in hashes):
        raise ValueError(f"block_hashes must be hex strings of 1..{MAX_HASH_BYTES} bytes")
    return hashes


def _gather(
    run: ExportedRun, lo: int, hi: int, buf: np.ndarray[Any, np.dtype[np.uint8]]
) -> int | None:
    """Worker thread: blocks [lo, hi) of the run into `buf` (K then V) and their checksum, or
    None when a block is gone. The checksum covers every byte sent and is computed here, while
    the previous chunk is on the wire."""
    half = (hi - lo) * run.bytes_per_block // 2
    view = buf.data.cast("B")
    k, v = view[:half], view[half : 2 * half]
    if not run.read(run.block_hashes[lo:hi], k, v):
        return None
    return chunk_checksum(view[: 2 * half], lo)


def _direct_socket(request: web.Request) -> socket.socket | None:
    """A duplicate of the connection's plain TCP socket, to send payload bytes with
    `loop.sock_sendall` (the kernel copies straight from our buffer; nothing is buffered in user
    space), or None (TLS, or no socket) to go through the transport instead."""
    transport = request.transport
    if transport is None or transport.get_extra_info("sslcontext") is not None:
        return None
    raw = transport.get_extra_info("socket")
    if raw is None or raw.type != socket.SOCK_STREAM:
        return None
    sock: socket.socket = raw.dup()
    sock.setblocking(False)
    return sock


async def _flushed(request: web.Request) -> asyncio.Transport:
    """The connection's transport once everything written through it (response head, earlier
    frames) is on the wire: direct socket writes must not overtake it."""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("peer went away mid-stream")
        if not transport.get_write_buffer_size():
            return transport
        await request.writer.drain()  # write limits are (0, 0): waits until flushed
        await asyncio.sleep(0)


async def _send(
    request: web.Request, sock: socket.socket | None, prefix: bytes, data: memoryview
) -> None:
    """Write `prefix + data` as one HTTP chunk. With `sock` (plain TCP): three `sock_sendall`s
    (size line + prefix, the payload, CRLF) straight from our buffer: the kernel takes what
    fits and the rest waits for the socket to drain, nothing is joined or copied in between
    (aiohttp's chunked writer joins each write into a new bytes object, and asyncio's transport
    (3.11) copies whatever the socket does not take at once). Without: the transport, a piece at
    a time, each once the previous one is flushed."""
    transport = await _flushed(request)
    size_line = f"{len(prefix) + len(data):x}\r\n".encode()
    if sock is not None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, size_line + prefix)
        await loop.sock_sendall(sock, data)
        await loop.sock_sendall(sock, b"\r\n")
        return
    transport.write(size_line + prefix)
    for pos in range(0, len(data), _SEND_PIECE):
        transport = await _flushed(request)
        transport.write(data[pos : pos + _SEND_PIECE])
    transport.write(b"\r\n")
    await request.writer.drain()


async def _stream_run(
    request: web.Request,
    run: ExportedRun,
    chunk_bytes: int,
    on_served: Callable[[int], None] | None,
    buffers: BufferPool,
) -> web.StreamResponse:
    n = len(run.block_hashes)
    chunk_blocks = max(1, chunk_bytes // run.bytes_per_block)
    ranges = [(lo, min(n, lo + chunk_blocks)) for lo in range(0, n, chunk_blocks)]
    header = json.dumps(
        {
            "start_block": run.start_block,
            "num_blocks": n,
            "block_hashes": [h.hex() for h in run.block_hashes],
            "dtype": run.dtype,
            "layout": list(run.layout),
            "bytes_per_block": run.bytes_per_block,
            "chunk_blocks": chunk_blocks,
        }
    ).encode()
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    head = _PREAMBLE.pack(MAGIC, VERSION, len(header)) + header
    sent = 0
    size = min(n, chunk_blocks) * run.bytes_per_block
    held: list[np.ndarray[Any, np.dtype[np.uint8]]] = []

    def gather(lo: int, hi: int) -> tuple[asyncio.Future[int | None], memoryview]:
        buf = buffers.take(size)
        held.append(buf)
        future = asyncio.ensure_future(asyncio.to_thread(_gather, run, lo, hi, buf))
        return future, buf.data.cast("B")[: (hi - lo) * run.bytes_per_block]

    transport = request.transport
    limits = transport.get_write_buffer_limits() if transport is not None else None
    sock = _direct_socket(request)
    pending = gather(*ranges[0])
    try:
        if transport is not None:
            # Pause at any buffered byte, resume once flushed: `_send` writes straight from the
            # send buffer, after whatever went through the transport before.
            transport.set_write_buffer_limits(high=0, low=0)
        # The preamble and header through aiohttp's writer: it also flushes the response head,
        # whichever way its version sends it, before any direct write.
        await response.write(head)
        head = b""
        for i, (lo, hi) in enumerate(ranges):
            future, data = pending
            checksum = await future
            if checksum is None:
                log.info("T2: block %d of the run is gone; ending the stream early", lo)
                break
            if i + 1 < len(ranges):
                pending = gather(*ranges[i + 1])  # gathered while this range is on the wire
            assert len(data) == (hi - lo) * run.bytes_per_block
            await _send(request, sock, head + _U32.pack(hi - lo), data)
            buffers.give(held.pop(0))  # the kernel (or asyncio's buffer) has its own copy now
            head = _U64.pack(checksum)
            sent += len(data)
        await response.write(head + _U32.pack(0))
        await response.write_eof()
    finally:
        if sock is not None:
            sock.close()  # the duplicate only; the connection is aiohttp's
        if limits is not None and transport is not None and not transport.is_closing():
            transport.set_write_buffer_limits(high=limits[1], low=limits[0])
        future, _ = pending
        if not future.done():  # a gather still running holds its buffer: let it finish first
            await asyncio.wait([future])
        for buf in held:
            buffers.give(buf)
        run.release()
    if on_served is not None:
        on_served(sent)
    return response


# -- client ---------------------------------------------------------------------------------


@dataclass(slots=True)
class FetchedRun:
    """Verified blocks [start_block, start_block + num_blocks). `k`/`v` hold
    `[layers, kv_heads, capacity_blocks * 16, head_dim]` in canonical layout, of which the first
    `num_blocks * 16` tokens are filled (fewer than announced when the peer stopped early)."""

    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    layout: tuple[int, int, int]
    capacity_blocks: int
    k: memoryview
    v: memoryview
    peer: str = ""
    partial: str = ""
    """Why the run ended before the announced length ("" when complete)."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True)
class FetchStats:
    """Outcome counts: `ok` or the reason the request went back to recompute."""

    outcomes: dict[str, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    blocks_fetched: int = 0

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


class FetchFailed(Exception):
    def __init__(self, outcome: str, detail: str = "") -> None:
        super().__init__(f"{outcome}: {detail}" if detail else outcome)
        self.outcome = outcome


class PeerFetcher:
    """Finds the peer with the longest run (via the hint index) and fetches it, or gives up.

    Never raises: `fetch` returns a verified `FetchedRun` or None, and counts why in `stats`.
    `max_concurrency` transfers run at once; a request that finds them all busy for
    `queue_wait_s` recomputes instead of queueing. Transfers use a connection of their own each
    (`fleet._receive`, receiving in place); `session` is kept for callers' convenience."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        secret: bytes | None,
        index: HintIndex,
        self_host: str,
        *,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.25,
        max_concurrency: int = 4,
        queue_wait_s: float = 0.005,
        max_bytes: int = 8 << 30,
        min_blocks: int = 1,
        resolve_url: Callable[[str], str | None] | None = None,
    ) -> None:
        self.session = session
        self.secret = secret
        self.index = index
        self.self_host = self_host
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.queue_wait_s = queue_wait_s
        self.max_bytes = max_bytes
        self.min_blocks = min_blocks
        self.resolve_url = resolve_url
        self.stats = FetchStats()
        self._slots = asyncio.Semaphore(max_concurrency)
        # Receive buffers given back by `recycle`: first-touch page faults of fresh memory cost
        # more than the copy itself (hundreds of MiB per fetch), so steady state reuses them.
        self._spare = BufferPool(2 * max_concurrency + 2)

    def _buffer(self, num_bytes: int) -> memoryview:
        return self._spare.take(num_bytes).data.cast("B")[:num_bytes]

    def recycle(self, run: FetchedRun) -> None:
        """Give a run's buffers back once nothing references them any more (after
        `import_blocks` copied them into the cache). Optional: unrecycled runs are just freed."""
        for view in (run.k, run.v):
            base = view.obj
            if isinstance(base, np.ndarray):
                self._spare.give(base)

    async def fetch(
        self,
        key: CacheKey,
        token_ids: Sequence[int],
        expected_hashes: Sequence[bytes],
        *,
        start_block: int = 0,
        expected_dtype: str | None = None,
        expected_layout: tuple[int, int, int] | None = None,
    ) -> FetchedRun | None:
        """Fetch blocks [start_block, ...) of (key, token_ids) from the best peer.

        `expected_hashes` is the full chain the caller computed for `token_ids`;
        `expected_layout` is (num_layers, num_kv_heads, head_dim)."""
        if not self.secret:
            self.stats.count("disabled")
            return None
        wanted = list(expected_hashes[start_block:])
        if len(wanted) < self.min_blocks:
            self.stats.count("too_short")
            return None
        runs = await self.index.lookup_runs(wanted, tenant=key.tenant_id)
        peer = best_peer(runs, exclude=self.self_host)
        if peer is None or peer[1] < self.min_blocks:
            self.stats.count("no_peer")
            return None
        host, num_blocks = peer
        url = await self._url(host)
        if url is None:
            self.stats.count("no_url")
            return None
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_wait_s)
        except TimeoutError:
            self.stats.count("busy")
            return None
        try:
            run = await asyncio.wait_for(
                self._fetch_from(url, key, token_ids, start_block, num_blocks), self.timeout_s
            )
        except TimeoutError:
            self.stats.count("timeout")
            return None
        except FetchFailed as exc:
            self.stats.count(exc.outcome)
            log.debug("T2 fetch from %s failed: %s", host, exc)
            return None
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: malformed HTTP
            self.stats.count("peer_error")
            log.debug("T2 fetch from %s failed: %r", host, exc)
            return None
        finally:
            self._slots.release()
        try:
            self._verify(run, wanted, start_block, expected_dtype, expected_layout)
        except FetchFailed as exc:
            self.stats.count(exc.outcome)
            log.warning("T2 run from %s rejected: %s", host, exc)
            return None
        run.peer = host
        self.stats.count(f"partial_{run.partial}" if run.partial else "ok")
        self.stats.bytes_fetched += 2 * len(run.k) * run.num_blocks // run.capacity_blocks
        self.stats.blocks_fetched += run.num_blocks
        return run

    async def _url(self, host: str) -> str | None:
        if self.resolve_url is not None:
            url = self.resolve_url(host)
            if url is not None:
                return url
        return await self.index.host_url(host)

    async def fetch_from(
        self, url: str, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> FetchedRun:
        """One transfer from a known peer; raises FetchFailed / aiohttp errors (for tests and
        the benchmark; `fetch` is the never-raising path)."""
        return await self._fetch_from(url, key, token_ids, start_block, max_blocks)

    async def _fetch_from(
        self, url: str, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> FetchedRun:
        assert self.secret
        body = {
            "key": key._asdict(),
            "token_ids": list(token_ids),
            "start_block": start_block,
            "max_blocks": max_blocks,
        }
        headers = {
            TENANT_HEADER: key.tenant_id,
            "Authorization": f"Bearer {peer_token(self.secret, key.tenant_id)}",
        }
        status, reader = await post(
            url, T2_PATH, body, headers, connect_timeout_s=self.connect_timeout_s
        )
        try:
            if status != 200:
                outcome = {404: "stale", 401: "refused", 403: "refused"}.get(status, "http")
                raise FetchFailed(outcome, f"HTTP {status}")
            return await self._read_run(reader)
        finally:
            reader.close()

    async def _read_run(self, reader: BodyReader) -> FetchedRun:
        try:
            magic, version, header_len = _PREAMBLE.unpack(await reader.exactly(_PREAMBLE.size))
            if magic != MAGIC or version != VERSION or header_len > MAX_HEADER_BYTES:
                raise FetchFailed("protocol", f"bad preamble {magic!r} v{version}")
            header = json.loads(await reader.exactly(header_len))
            hashes = tuple(bytes.fromhex(h) for h in header["block_hashes"])
            dtype = str(header["dtype"])
            layers, heads, head_dim = _layout(header["layout"])
            bytes_per_block = int(header["bytes_per_block"])
            element_bytes = _DTYPE_BYTES.get(dtype)
            if element_bytes is None or bytes_per_block != (
                2 * layers * heads * BLOCK_SIZE * head_dim * element_bytes
            ):
                raise FetchFailed("protocol", f"{bytes_per_block} bytes per block of {dtype}")
            n = len(hashes)
            if n != int(header["num_blocks"]) or not 0 < n * bytes_per_block <= self.max_bytes:
                raise FetchFailed("too_large", f"{n} blocks of {bytes_per_block} bytes")
            run = FetchedRun(
                start_block=int(header["start_block"]),
                block_hashes=(),
                dtype=dtype,
                layout=(layers, heads, head_dim),
                capacity_blocks=n,
                k=self._buffer(n * bytes_per_block // 2),
                v=self._buffer(n * bytes_per_block // 2),
            )
        except asyncio.IncompleteReadError as exc:
            raise FetchFailed("short_read", f"{len(exc.partial)} of {exc.expected} bytes") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise FetchFailed("protocol", repr(exc)) from exc
        verified, failure = await _read_chunks(reader, run, bytes_per_block)
        run.block_hashes = hashes[:verified]
        if failure is not None:
            if verified == 0:
                raise failure
            run.partial = failure.outcome
        return run

    def _verify(
        self,
        run: FetchedRun,
        wanted: Sequence[bytes],
        start_block: int,
        dtype: str | None,
        layout: tuple[int, int, int] | None,
    ) -> None:
        n = run.num_blocks
        if run.start_block != start_block or not 0 < n <= len(wanted):
            raise FetchFailed("protocol", f"run [{run.start_block}, +{n}) not requested")
        if tuple(run.block_hashes) != tuple(wanted[:n]):
            raise FetchFailed("hash_mismatch", "peer blocks are not the requested chain")
        if dtype is not None and run.dtype != dtype:
            raise FetchFailed("layout_mismatch", f"dtype {run.dtype} != {dtype}")
        if layout is not None and run.layout != layout:
            raise FetchFailed("layout_mismatch", f"layout {run.layout} != {layout}")


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _layout(raw: Any) -> tuple[int, int, int]:
    if not isinstance(raw, list) or len(raw) != 3 or not all(type(x) is int and x > 0 for x in raw):
        raise ValueError(f"layout must be 3 positive integers, got {raw!r}")
    return (raw[0], raw[1], raw[2])


def _check_rows(views: Sequence[memoryview], first_block: int) -> int:
    """Worker thread: the checksum of one received chunk, over its rows where they landed (K rows
    then V rows, in wire order); equal to `chunk_checksum` of the contiguous chunk."""
    digest = xxhash.xxh3_64(seed=first_block)
    for view in views:
        digest.update(view)
    return digest.intdigest()


async def _read_chunks(
    reader: BodyReader, run: FetchedRun, bytes_per_block: int
) -> tuple[int, FetchFailed | None]:
    """Read chunks into place; returns (blocks verified from the start, why it stopped early).

    A chunk's K rows (one per layer and KV head) are received straight into their strided places
    in the canonical K buffer and its V rows into V (scatter reads: a few large socket reads per
    chunk, no staging copy); a worker thread checksums the chunk's rows where they landed while
    the next chunk arrives. A chunk that fails its checksum is not counted as verified, so its
    (overwritten) rows are never used."""
    layers, heads, _ = run.layout
    num_rows = layers * heads
    row_per_block = bytes_per_block // (2 * num_rows)
    row_stride = run.capacity_blocks * row_per_block
    checks: list[tuple[asyncio.Future[int], int, int]] = []
    failure: FetchFailed | None = None
    try:
        lo = 0
        while True:
            (n,) = _U32.unpack(await reader.exactly(_U32.size))
            if n == 0:
                break
            if lo + n > run.capacity_blocks:
                raise FetchFailed("protocol", f"chunk of {n} blocks at block {lo}")
            a, b = lo * row_per_block, (lo + n) * row_per_block
            views = [
                buf[row * row_stride + a : row * row_stride + b]
                for buf in (run.k, run.v)
                for row in range(num_rows)
            ]
            await reader.into_all(views)
            (expected,) = _U64.unpack(await reader.exactly(_U64.size))
            check = asyncio.ensure_future(asyncio.to_thread(_check_rows, views, lo))
            checks.append((check, expected, n))
            lo += n
    except asyncio.IncompleteReadError as exc:
        failure = FetchFailed("short_read", f"{len(exc.partial)} of {exc.expected} bytes")
    except FetchFailed as exc:
        failure = exc
    finally:
        # Every worker finishes before the run is handed on (or its buffers recycled).
        await asyncio.gather(*(c for c, _, _ in checks), return_exceptions=True)
    verified = 0
    for checksum, expected, n in checks:
        if failure is not None and failure.outcome == "checksum":
            continue
        if await checksum != expected:
            failure = FetchFailed("checksum", f"chunk at block {verified}")
            continue
        verified += n
    return verified, failure
