"""T2 peer transfer: a replica serves the block runs it holds to authenticated peers.

Protocol (version 1), one HTTP request per block run:

    POST /kv/v1/blocks
    X-Kvfleet-Tenant: <tenant>
    Authorization: Bearer <hex HMAC-SHA256(fleet secret, "kvfleet-t2-v1\\0" + tenant)>
    {"key": {CacheKey fields}, "token_ids": [...], "start_block": m, "max_blocks": n}

The credential is scoped to one tenant and checked in constant time (`hmac.compare_digest`); the
request's `key.tenant_id` must equal that tenant. The server never takes block hashes from the
caller: it recomputes the chain from (key, token_ids), and since the key's tenant is in every
hash, a request for tenant B can only ever reach tenant B's blocks (or allow-listed platform
blocks). No secret configured -> the endpoint refuses everything (fail closed).

Answers: 200 with a run of at least one block; 404 when the server holds no block at or after
`start_block` (a stale hint); 400 bad request; 401 bad credential; 403 tenant mismatch; 503
disabled. The 200 body (`Content-Length` known up front, octet-stream):

    preamble   b"KVT2" | u8 version = 1 | 3 zero bytes | u32 LE header length
    header     JSON {"start_block", "num_blocks", "block_hashes": [hex], "dtype",
                     "shape": [layers, kv_heads, num_blocks * 16, head_dim],
                     "tensor_bytes", "frame_bytes"}
    frames     K then V, canonical layout, cut into frames of <= frame_bytes:
               u32 LE payload length | payload | u32 LE crc32(payload)

The fetcher checks the hashes against the chain it computed itself, the dtype/shape against its
layout, the length of everything, and every frame's CRC; any mismatch, a timeout, a refused
connection or a short read discards the transfer and the request recomputes (same output).
CRC32 (not a cryptographic hash) because peers are authenticated: the checksum guards against
corruption, at ~2 GB/s instead of blake2b's ~0.4 GB/s.

This module is torch-free (it moves bytes); `kvfleet_runtime.fleet.replica` adapts it to
`PrefixCache` tensors.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import numpy as np
from aiohttp import web

from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey
from kvfleet_runtime.fleet.index import HintIndex, best_peer

__all__ = [
    "DEFAULT_FRAME_BYTES",
    "T2_PATH",
    "TENANT_HEADER",
    "BlockSource",
    "ExportedRun",
    "FetchStats",
    "FetchedRun",
    "PeerFetcher",
    "peer_routes",
    "peer_token",
]

log = logging.getLogger(__name__)

T2_PATH = "/kv/v1/blocks"
TENANT_HEADER = "X-Kvfleet-Tenant"
MAGIC = b"KVT2"
VERSION = 1
_PREAMBLE = struct.Struct("<4sB3xI")
_U32 = struct.Struct("<I")
DEFAULT_FRAME_BYTES = 1 << 20
MAX_HEADER_BYTES = 1 << 22
_READ_BUFSIZE = 4 << 20
"""Client-side read buffer: bulk bodies stall on aiohttp's 64 KiB default (pause/resume churn)."""
_TOKEN_DOMAIN = b"kvfleet-t2-v1\x00"


def peer_token(secret: bytes, tenant_id: str) -> str:
    """The tenant-scoped bearer credential a peer presents for `tenant_id`."""
    return hmac.new(secret, _TOKEN_DOMAIN + tenant_id.encode("utf-8"), hashlib.sha256).hexdigest()


@dataclass(slots=True)
class ExportedRun:
    """A run of held blocks, K and V as raw bytes in canonical layout."""

    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    shape: tuple[int, int, int, int]
    """[num_layers, num_kv_heads, num_blocks * 16, head_dim] of K (and of V)."""
    k: memoryview
    v: memoryview


class BlockSource(Protocol):
    async def export(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> ExportedRun | None:
        """Longest held run of blocks of (key, token_ids) from `start_block`, at most
        `max_blocks`; None when block `start_block` is not held."""


# -- server ---------------------------------------------------------------------------------


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


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
    secret: bytes | None,
    *,
    max_tokens: int = 1 << 20,
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    on_served: Callable[[int], None] | None = None,
) -> list[web.RouteDef]:
    """The T2 endpoint for an aiohttp app: `app.add_routes(peer_routes(source, secret))`.

    `secret=None` (or empty) keeps the route but refuses every request. `on_served(bytes)` is
    called after each complete transfer (for metrics)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if not secret:
            return _error(503, "peer transfer is disabled: no fleet secret configured")
        tenant = request.headers.get(TENANT_HEADER, "")
        presented = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        expected = peer_token(secret, tenant)
        # compare_digest over the ASCII bytes: constant time in the presented value.
        if not tenant or not hmac.compare_digest(presented.encode(), expected.encode()):
            return _error(401, "peer credential missing or invalid")
        try:
            key, token_ids, start_block, max_blocks = _parse_request(
                await request.json(), max_tokens
            )
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
        return await _stream_run(request, run, frame_bytes, on_served)

    return [web.post(T2_PATH, handle)]


def _frames(data: memoryview, frame_bytes: int) -> list[memoryview]:
    return [data[i : i + frame_bytes] for i in range(0, len(data), frame_bytes)] or [data]


async def _stream_run(
    request: web.Request,
    run: ExportedRun,
    frame_bytes: int,
    on_served: Callable[[int], None] | None,
) -> web.StreamResponse:
    k, v = run.k.cast("B"), run.v.cast("B")
    assert len(k) == len(v)
    header = json.dumps(
        {
            "start_block": run.start_block,
            "num_blocks": len(run.block_hashes),
            "block_hashes": [h.hex() for h in run.block_hashes],
            "dtype": run.dtype,
            "shape": list(run.shape),
            "tensor_bytes": len(k),
            "frame_bytes": frame_bytes,
        }
    ).encode()
    frames = _frames(k, frame_bytes) + _frames(v, frame_bytes)
    total = _PREAMBLE.size + len(header) + sum(len(f) + 2 * _U32.size for f in frames)
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = total
    await response.prepare(request)
    head = _PREAMBLE.pack(MAGIC, VERSION, len(header)) + header
    for frame in frames:
        # The CRC is computed in a thread (zlib releases the GIL) while the frame is written;
        # the small pieces around each frame go out in one write with the previous CRC.
        crc = asyncio.ensure_future(asyncio.to_thread(zlib.crc32, frame))
        await response.write(head + _U32.pack(len(frame)))
        await response.write(frame)
        head = _U32.pack(await crc)
    await response.write(head)
    await response.write_eof()
    if on_served is not None:
        on_served(2 * len(k))
    return response


# -- client ---------------------------------------------------------------------------------


@dataclass(slots=True)
class FetchedRun:
    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    shape: tuple[int, int, int, int]
    k: memoryview
    """Writable, uninitialised until filled (no zeroing pass over hundreds of MiB)."""
    v: memoryview
    peer: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True)
class FetchStats:
    """Outcome counts: `ok` or the reason the request went back to recompute."""

    outcomes: dict[str, int] = field(default_factory=dict)
    bytes_fetched: int = 0

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
    `queue_wait_s` recomputes instead of queueing."""

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
        peer = best_peer(await self.index.lookup_runs(wanted), exclude=self.self_host)
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
        except (aiohttp.ClientError, OSError) as exc:
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
        self.stats.count("ok")
        self.stats.bytes_fetched += len(run.k) + len(run.v)
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
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        async with self.session.post(
            url.rstrip("/") + T2_PATH,
            json=body,
            headers=headers,
            timeout=timeout,
            read_bufsize=_READ_BUFSIZE,
        ) as resp:
            if resp.status != 200:
                outcome = {404: "stale", 401: "refused", 403: "refused"}.get(resp.status, "http")
                raise FetchFailed(outcome, f"HTTP {resp.status}")
            return await self._read_run(resp.content)

    async def _read_run(self, stream: aiohttp.StreamReader) -> FetchedRun:
        reader = _ChunkReader(stream)
        try:
            magic, version, header_len = _PREAMBLE.unpack(await reader.exactly(_PREAMBLE.size))
            if magic != MAGIC or version != VERSION or header_len > MAX_HEADER_BYTES:
                raise FetchFailed("protocol", f"bad preamble {magic!r} v{version}")
            header = json.loads(await reader.exactly(header_len))
            tensor_bytes = int(header["tensor_bytes"])
            if not (tensor_bytes > 0 and 2 * tensor_bytes <= self.max_bytes):
                raise FetchFailed("too_large", f"{tensor_bytes} bytes")
            run = FetchedRun(
                start_block=int(header["start_block"]),
                block_hashes=tuple(bytes.fromhex(h) for h in header["block_hashes"]),
                dtype=str(header["dtype"]),
                shape=_shape(header["shape"]),
                k=_empty(tensor_bytes),
                v=_empty(tensor_bytes),
            )
            for buf in (run.k, run.v):
                await _read_frames(reader, buf)
        except asyncio.IncompleteReadError as exc:
            raise FetchFailed("short_read", f"{len(exc.partial)} of {exc.expected} bytes") from exc
        except aiohttp.ClientPayloadError as exc:  # the peer closed mid-body
            raise FetchFailed("short_read", str(exc)) from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise FetchFailed("protocol", repr(exc)) from exc
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
        layers, heads, tokens, head_dim = run.shape
        if tokens != n * BLOCK_SIZE or (layout is not None and (layers, heads, head_dim) != layout):
            raise FetchFailed("layout_mismatch", f"shape {run.shape}")


def _empty(num_bytes: int) -> memoryview:
    return np.empty(num_bytes, dtype=np.uint8).data.cast("B")


def _shape(raw: Any) -> tuple[int, int, int, int]:
    if not isinstance(raw, list) or len(raw) != 4 or not all(type(x) is int for x in raw):
        raise ValueError(f"shape must be 4 integers, got {raw!r}")
    return (raw[0], raw[1], raw[2], raw[3])


class _ChunkReader:
    """Reads a response body chunk by chunk (`readany`), copying payload bytes straight into
    their destination: one copy and one CRC pass per byte, no intermediate joins."""

    def __init__(self, stream: aiohttp.StreamReader) -> None:
        self.stream = stream
        self.chunk = memoryview(b"")
        self.num_read = 0

    async def _next(self, wanted: int) -> None:
        data = await self.stream.readany()
        if not data:
            raise asyncio.IncompleteReadError(b"", wanted)
        self.chunk = memoryview(data)

    async def exactly(self, n: int) -> bytes:
        parts: list[bytes] = []
        while n:
            if not self.chunk:
                await self._next(n)
            take = self.chunk[:n]
            parts.append(bytes(take))
            self.chunk = self.chunk[len(take) :]
            n -= len(take)
            self.num_read += len(take)
        return b"".join(parts)

    async def into(self, out: memoryview) -> None:
        """Fill `out` from the stream."""
        pos = 0
        while pos < len(out):
            if not self.chunk:
                await self._next(len(out) - pos)
            take = self.chunk[: len(out) - pos]
            out[pos : pos + len(take)] = take
            self.chunk = self.chunk[len(take) :]
            pos += len(take)
        self.num_read += pos


async def _read_frames(reader: _ChunkReader, out: memoryview) -> None:
    """Read K or V. Each frame's CRC runs in a thread (zlib releases the GIL) while the next
    frame is received; all are checked before the run is returned."""
    checks: list[tuple[asyncio.Future[int], int, int]] = []
    try:
        pos = 0
        while pos < len(out):
            (length,) = _U32.unpack(await reader.exactly(_U32.size))
            if length == 0 or pos + length > len(out):
                raise FetchFailed("protocol", f"frame of {length} bytes at offset {pos}")
            frame = out[pos : pos + length]
            await reader.into(frame)
            (expected,) = _U32.unpack(await reader.exactly(_U32.size))
            checks.append(
                (asyncio.ensure_future(asyncio.to_thread(zlib.crc32, frame)), expected, pos)
            )
            pos += length
        for crc, expected, offset in checks:
            if await crc != expected:
                raise FetchFailed("checksum", f"frame at offset {offset}")
    finally:
        for crc, _, _ in checks:
            crc.cancel()
