"""T2, the serving side: the peer routes (`POST /kv/v1/blocks`, `POST /kv/v1/held`) over a
`BlockSource`, streaming a run chunk by chunk from reused send buffers (`fleet.t2_protocol` has
the format, the credential and the checksum); and T2 over NIXL's control routes
(`POST /kv/v1/lease`, `POST /kv/v1/lease/release`, `lease_routes`) over a `LeaseSource`: the
run pinned for a short lease and answered as descriptors the fetcher READs one-sided."""

from __future__ import annotations

import asyncio
import base64
import hmac
import itertools
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from aiohttp import web

from kvfleet_runtime.api import ApiError, error_response, parse_json, read_body
from kvfleet_runtime.auth import MAX_CLOCK_SKEW_S
from kvfleet_runtime.cache import BLOCK_SIZE, CacheKey
from kvfleet_runtime.fleet.t2_lease import LeaseTable, PoolGeometry
from kvfleet_runtime.fleet.t2_protocol import (
    MAGIC,
    MAX_HASH_BYTES,
    MAX_PEER_TOKEN_TTL_S,
    MAX_PROBE_BLOCKS,
    PREAMBLE,
    U32,
    U64,
    VERSION,
    BufferPool,
    PeerSecrets,
    WireOrder,
    chunk_checksum,
    parse_peer_token,
    token_mac,
)
from kvfleet_runtime.wire import HELD_PATH, LEASE_PATH, RELEASE_PATH, T2_PATH, TENANT_HEADER

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_PEER_BODY_BYTES",
    "DEFAULT_PEER_BODY_TIMEOUT_S",
    "MAX_IDLE_SEND_BUFFERS",
    "BlockSource",
    "ExportedRun",
    "LeaseSource",
    "LeasedRun",
    "NixlServing",
    "lease_routes",
    "peer_routes",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 16 << 20
"""Target K+V bytes per chunk (at least one block)."""


_SEND_PIECE = 4 << 20
"""Without a direct socket (TLS): bytes handed to the transport per write; asyncio (3.11) copies
whatever the socket cannot take at once."""


MAX_IDLE_SEND_BUFFERS = 4
"""Send buffers kept for reuse (two per stream: one on the wire, one being gathered)."""


DEFAULT_PEER_BODY_BYTES = 16 << 20
"""Largest request body on the peer routes: a block request for `max_tokens` (2**20) ids is
~11 MB of JSON, a full held probe ~0.3 MB."""


DEFAULT_PEER_BODY_TIMEOUT_S = 10.0
"""A peer's request body must arrive within this (408 after): the OpenAI routes' bound. A peer
announcing 1,000 bytes and sending 8 would otherwise hold the connection for as long as it likes;
peers sit on the cluster network, where 16 MiB takes well under a second."""


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
    read: Callable[[Sequence[bytes], WireOrder, memoryview], bool]
    """Blocking (run in a worker thread): `read(hashes, order, out)` writes the KV bytes of
    consecutive hashes of the run into `out` in the wire order `order` (`t2_protocol.chunk_axes`;
    exactly that many bytes, a reused send buffer); False when one is no longer held."""
    release: Callable[[], None] = lambda: None
    """Called once when the stream ends (e.g. to drop refs held while reading)."""
    views: Callable[[int, int], Sequence[memoryview]] | None = None
    """Optional: blocks [lo, hi) of the run (0 = its first block) as their bytes in the wire
    order `order` where they lie, valid until `release`. Only for memory that cannot change
    while the run streams (blocks held by refs in slots that never move): a fetcher that asks
    for that order is then sent the run from it with no gather, checksummed there."""
    order: WireOrder = WireOrder.CANONICAL
    """The order `views` lie in."""


class BlockSource(Protocol):
    async def export(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> ExportedRun | None:
        """Longest held run of blocks of (key, token_ids) from `start_block`, at most
        `max_blocks`; None when block `start_block` is not held."""


@dataclass(slots=True)
class LeasedRun:
    """A run of held blocks pinned where they lie (`PrefixCache.pin`) until `unpin`."""

    start_block: int
    block_hashes: tuple[bytes, ...]
    dtype: str
    layout: tuple[int, int, int]
    """(num_layers, num_kv_heads, head_dim)."""
    bytes_per_block: int
    slots: tuple[tuple[int, int], ...]
    """(pool, slot) of each block: pool i is `NixlServing.geometries[i]`."""
    unpin: Callable[[], None]


class LeaseSource(Protocol):
    async def lease(
        self, key: CacheKey, token_ids: Sequence[int], start_block: int, max_blocks: int
    ) -> LeasedRun | None:
        """The longest held run of (key, token_ids) from `start_block` (at most `max_blocks`),
        pinned; None when block `start_block` is not held."""


@dataclass(frozen=True, slots=True)
class NixlServing:
    """What the lease routes answer of this replica's NIXL agent (`fleet.t2_nixl.NixlAgent`)."""

    agent_name: str
    metadata: bytes
    geometries: tuple[PoolGeometry, ...]
    hold_progress: Callable[[], Callable[[], None]] | None = None
    """`NixlAgent.hold_progress`: the agent is progressed while a lease is live."""


_ERROR_CODES = {400: "invalid_value", 401: "invalid_peer_credential", 403: "wrong_tenant",
                404: "not_held", 429: "lease_budget", 501: "no_nixl", 503: "unavailable"}


def _error(status: int, message: str) -> web.Response:
    """The replica's error envelope (peer routes share the replica's app and its clients)."""
    return error_response(status, message, code=_ERROR_CODES.get(status))


async def _body(request: web.Request, limit_bytes: int, timeout_s: float) -> Any:
    """The JSON body within the shared bounds (size, time, encoding; numbers, depth, Unicode):
    an `ApiError` (400, 408, 413) otherwise."""
    return parse_json(await read_body(request, limit_bytes, timeout_s))


def _refusal(exc: ApiError) -> web.Response:
    return error_response(exc.status, exc.message, code=exc.code, headers=exc.headers)


def _parse_request(body: Any,
                   max_tokens: int) -> tuple[CacheKey, list[int], int, int, WireOrder]:
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
    order = body.get("order", WireOrder.CANONICAL.value)  # fetchers before it land canonical
    if order not in tuple(WireOrder):
        raise ValueError(f"order must be one of {[o.value for o in WireOrder]}, got {order!r}")
    return key, token_ids, start_block, max_blocks, WireOrder(order)


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
            key, token_ids, start_block, max_blocks, order = _parse_request(
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
        return await _stream_run(request, run, order, chunk_bytes, on_served, pool)

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


def lease_routes(
    source: LeaseSource,
    secret: bytes | PeerSecrets | None,
    serving: NixlServing | None,
    leases: LeaseTable,
    *,
    max_tokens: int = 1 << 20,
    on_served: Callable[[int], None] | None = None,
    max_body_bytes: int = DEFAULT_PEER_BODY_BYTES,
    body_timeout_s: float = DEFAULT_PEER_BODY_TIMEOUT_S,
) -> list[web.RouteDef]:
    """T2 over NIXL's control routes (`app.add_routes(lease_routes(...))`), authenticated as
    the block route is (the tenant credential; the chain recomputed here from key and tokens,
    never hashes from the caller):

        POST /kv/v1/lease    {key, token_ids, start_block, max_blocks, "agent"?}
          -> 200 {lease, ttl_s, start_block, block_hashes, dtype, layout, bytes_per_block,
                  agent, metadata (base64; left out when the request's "agent" is this one),
                  pools: [PoolGeometry], slots: [[pool, slot], ...]}
             404 nothing held at start_block, 429 the lease budget is spent, 501 no NIXL here
        POST /kv/v1/lease/release  {lease}  -> 200 {"held": true | false}

    The run's blocks stay pinned until the release or the lease's expiry (`leases.ttl_s`),
    whichever is first; `held` true means they were pinned all along, so what the fetcher read
    is the run. `on_served(bytes)` is called for each run released live. The agent metadata goes
    out only here, to an authenticated peer."""

    async def handle_lease(request: web.Request) -> web.StreamResponse:
        tenant = _authenticate(request, secret)
        if isinstance(tenant, web.Response):
            return tenant
        if serving is None:
            return _error(501, "this replica serves T2 over HTTP only (no NIXL agent)")
        try:
            body = await _body(request, max_body_bytes, body_timeout_s)
            key, token_ids, start_block, max_blocks, _ = _parse_request(body, max_tokens)
        except ApiError as exc:
            return _refusal(exc)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        if key.tenant_id != tenant:
            return _error(403, f"credential is for tenant {tenant!r}, key is for another tenant")
        try:
            run = await source.lease(key, token_ids, start_block, max_blocks)
        except ValueError as exc:
            return _error(400, str(exc))
        if run is None or not run.block_hashes:
            return _error(404, f"no block held at or after block {start_block}")
        let_go = serving.hold_progress() if serving.hold_progress is not None else _nothing

        def end() -> None:
            run.unpin()
            let_go()

        lease = leases.grant(tenant, len(run.block_hashes), end,
                             num_bytes=len(run.block_hashes) * run.bytes_per_block)
        if lease is None:  # the run was unpinned by the refusal
            return _error(429, "too many blocks leased to peers; recompute")
        asyncio.get_running_loop().call_later(leases.ttl_s, leases.expire)
        answer: dict[str, Any] = {
            "lease": lease.lease_id,
            "ttl_s": leases.ttl_s,
            "start_block": run.start_block,
            "block_hashes": [h.hex() for h in run.block_hashes],
            "dtype": run.dtype,
            "layout": list(run.layout),
            "bytes_per_block": run.bytes_per_block,
            "agent": serving.agent_name,
            "pools": [g.to_json() for g in serving.geometries],
            "slots": [list(s) for s in run.slots],
        }
        if body.get("agent") != serving.agent_name:
            answer["metadata"] = base64.b64encode(serving.metadata).decode()
        return web.json_response(answer)

    async def handle_release(request: web.Request) -> web.StreamResponse:
        tenant = _authenticate(request, secret)
        if isinstance(tenant, web.Response):
            return tenant
        try:
            body = await _body(request, max_body_bytes, body_timeout_s)
        except ApiError as exc:
            return _refusal(exc)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(400, str(exc))
        lease_id = body.get("lease") if isinstance(body, dict) else None
        if not isinstance(lease_id, str) or not lease_id:
            return _error(400, 'body must be {"lease": "<id>"}')
        lease = leases.release(lease_id, tenant)
        if lease is not None and on_served is not None:
            on_served(lease.num_bytes)
        return web.json_response({"held": lease is not None})

    return [web.post(LEASE_PATH, handle_lease), web.post(RELEASE_PATH, handle_release)]


def _nothing() -> None:
    return None


def _authenticate(request: web.Request,
                  secret: bytes | PeerSecrets | None) -> str | web.Response:
    """The tenant the request's credential is for, or the error response to send."""
    if not secret:
        return _error(503, "peer transfer is disabled: no fleet secret configured")
    accepted = secret.accepted if isinstance(secret, PeerSecrets) else (secret,)
    tenant = request.headers.get(TENANT_HEADER, "")
    parsed = parse_peer_token(request.headers.get("Authorization"))
    # (aiohttp hands undecodable header bytes on as surrogates: a tenant holding any is no
    # tenant, and is never encoded)
    if not tenant or parsed is None or not _encodable(tenant):
        return _error(401, "peer credential missing or invalid")
    expires, mac = parsed
    now = time.time()
    if not now - MAX_CLOCK_SKEW_S <= expires <= now + MAX_PEER_TOKEN_TTL_S + MAX_CLOCK_SKEW_S:
        return _error(401, "peer credential expired (or claims too long a life)")
    # compare_digest over the ASCII bytes: constant time in the presented value; every accepted
    # secret is tried, so which one matched (a rotation's old or new) does not show in the time.
    matched = False
    for key in accepted:
        matched |= hmac.compare_digest(mac.encode(), token_mac(key, tenant, expires).encode())
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
    run: ExportedRun, order: WireOrder, lo: int, hi: int,
    buf: np.ndarray[Any, np.dtype[np.uint8]],
) -> int | None:
    """Worker thread: blocks [lo, hi) of the run into `buf` in `order` and their checksum, or
    None when a block is gone. The checksum covers every byte sent and is computed here, while
    the previous chunk is on the wire."""
    data = buf.data.cast("B")[: (hi - lo) * run.bytes_per_block]
    if not run.read(run.block_hashes[lo:hi], order, data):
        return None
    return chunk_checksum(data, lo)


_MAX_IOVECS = 1024
"""Views per `sendmsg` (Linux's IOV_MAX)."""


async def _send_views(
    request: web.Request, sock: socket.socket, prefix: bytes, views: Sequence[memoryview]
) -> None:
    """Write `prefix` then `views` as one HTTP chunk straight from where the views lie:
    `sendmsg` scatter writes (the kernel copies from each view), waiting for the socket to
    drain when it is full; nothing is gathered or copied in user space."""
    await _flushed(request)
    loop = asyncio.get_running_loop()
    total = len(prefix) + sum(len(v) for v in views)
    await loop.sock_sendall(sock, f"{total:x}\r\n".encode() + prefix)
    pending = deque(v for v in views if len(v))
    while pending:
        try:
            sent = sock.sendmsg(list(itertools.islice(pending, _MAX_IOVECS)))
        except (BlockingIOError, InterruptedError):
            sent = 0
        if not sent:
            writable = loop.create_future()
            loop.add_writer(sock.fileno(), _set_done, writable)
            try:
                await writable
            finally:
                loop.remove_writer(sock.fileno())
            continue
        while sent:
            head = pending[0]
            if sent < len(head):
                pending[0] = head[sent:]
                break
            sent -= len(head)
            pending.popleft()
    await loop.sock_sendall(sock, b"\r\n")


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


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
    order: WireOrder,
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
            "order": order.value,
        }
    ).encode()
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    head = PREAMBLE.pack(MAGIC, VERSION, len(header)) + header
    sent = 0
    size = min(n, chunk_blocks) * run.bytes_per_block
    held: list[np.ndarray[Any, np.dtype[np.uint8]]] = []

    def gather(lo: int, hi: int) -> tuple[asyncio.Future[int | None], memoryview]:
        buf = buffers.take(size)
        held.append(buf)
        future = asyncio.ensure_future(asyncio.to_thread(_gather, run, order, lo, hi, buf))
        return future, buf.data.cast("B")[: (hi - lo) * run.bytes_per_block]

    transport = request.transport
    limits = transport.get_write_buffer_limits() if transport is not None else None
    sock = _direct_socket(request)
    if run.views is not None and run.order is order and sock is not None:
        return await _stream_in_place(request, response, run, ranges, head, sock, transport,
                                      limits, on_served)
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
            await _send(request, sock, head + U32.pack(hi - lo), data)
            buffers.give(held.pop(0))  # the kernel (or asyncio's buffer) has its own copy now
            head = U64.pack(checksum)
            sent += len(data)
        await response.write(head + U32.pack(0))
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


async def _stream_in_place(
    request: web.Request,
    response: web.StreamResponse,
    run: ExportedRun,
    ranges: list[tuple[int, int]],
    head: bytes,
    sock: socket.socket,
    transport: asyncio.Transport | None,
    limits: tuple[int, int] | None,
    on_served: Callable[[int], None] | None,
) -> web.StreamResponse:
    """`_stream_run` for a run that exposes its memory (`ExportedRun.views`): each chunk goes
    from where it lies to the socket, its checksum taken there by a worker thread while it is
    sent (the checksum is the next frame's first field, so it is awaited after the send)."""
    assert run.views is not None
    sent = 0
    checksum: asyncio.Future[int] | None = None
    try:
        if transport is not None:
            transport.set_write_buffer_limits(high=0, low=0)
        await response.write(head)
        head = b""
        for lo, hi in ranges:
            views = run.views(lo, hi)
            checksum = asyncio.ensure_future(asyncio.to_thread(chunk_checksum, views, lo))
            await _send_views(request, sock, head + U32.pack(hi - lo), views)
            head = U64.pack(await checksum)
            sent += sum(len(v) for v in views)
        await response.write(head + U32.pack(0))
        await response.write_eof()
    finally:
        sock.close()  # the duplicate only; the connection is aiohttp's
        if limits is not None and transport is not None and not transport.is_closing():
            transport.set_write_buffer_limits(high=limits[1], low=limits[0])
        if checksum is not None and not checksum.done():  # let the reader finish first
            await asyncio.wait([checksum])
        run.release()
    if on_served is not None:
        on_served(sent)
    return response
