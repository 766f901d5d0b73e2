"""The T2 200 body, byte for byte as docs/fleet.md describes it (protocol version 3), read with a
plain HTTP client: preamble, JSON header, chunks framed `u32 n | K | V | u64 xxh3_64(K || V,
seed = first block)`, end marker; and the checksum's properties the fetcher relies on."""

from __future__ import annotations

import json
import struct

import aiohttp
import numpy as np
import pytest
import torch
import xxhash
from aiohttp import web

from kvfleet_runtime.cache import BLOCK_SIZE
from kvfleet_runtime.fleet import (
    CacheBlockSource,
    EmbeddedHintIndex,
    PeerFetcher,
    peer_routes,
    peer_token,
    t2_serve,
)
from kvfleet_runtime.fleet._receive import BodyReader
from kvfleet_runtime.fleet.t2_protocol import VERSION, chunk_checksum
from kvfleet_runtime.wire import T2_PATH, TENANT_HEADER
from tests.runtime.fleet.t2_support import (
    KEY_A,
    LAYOUT,
    SECRET,
    TOKENS,
    make_cache,
    start_app,
    store,
)


def test_checksum_is_xxh3_64_seeded_with_the_chunk_position() -> None:
    data = memoryview(bytes(range(256)) * 64)
    assert chunk_checksum(data, 0) == xxhash.xxh3_64_intdigest(bytes(data))
    assert chunk_checksum(data, 3) == xxhash.xxh3_64_intdigest(bytes(data), seed=3)
    assert chunk_checksum(data, 3) != chunk_checksum(data, 0)  # a chunk out of place fails
    flipped = bytearray(data)
    flipped[1000] ^= 0x01
    assert chunk_checksum(memoryview(flipped), 3) != chunk_checksum(data, 3)


def test_checksum_over_received_rows_equals_the_contiguous_chunk() -> None:
    """The fetcher hashes a chunk's rows where they landed (strided in the canonical buffers or
    the caller's pool), the in-place server where they lie: the same checksum as the chunk."""
    rng = np.random.default_rng(0)
    rows, stride, a, b = 6, 40, 8, 24
    k = rng.integers(0, 256, rows * stride, dtype=np.uint8)
    v = rng.integers(0, 256, rows * stride, dtype=np.uint8)
    views = [
        buf.data.cast("B")[r * stride + a : r * stride + b] for buf in (k, v) for r in range(rows)
    ]
    wire = np.concatenate([buf.reshape(rows, stride)[:, a:b].ravel() for buf in (k, v)])
    assert chunk_checksum(views, 5) == chunk_checksum(wire.data.cast("B"), 5)


async def test_body_is_the_documented_frame_format() -> None:
    cache = make_cache()
    k, v = store(cache, KEY_A, TOKENS)
    block_bytes = LAYOUT.bytes_per_block
    app = web.Application()
    app.add_routes(peer_routes(CacheBlockSource(cache), SECRET, chunk_bytes=3 * block_bytes))
    url, runner = await start_app(app)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"key": KEY_A._asdict(), "token_ids": TOKENS, "start_block": 1, "max_blocks": 7}
            headers = {
                TENANT_HEADER: KEY_A.tenant_id,
                "Authorization": f"Bearer {peer_token(SECRET, KEY_A.tenant_id)}",
            }
            async with session.post(url + T2_PATH, json=body, headers=headers) as resp:
                assert resp.status == 200
                wire = await resp.read()
    finally:
        await runner.cleanup()

    magic, version, header_len = struct.unpack_from("<4sB3xI", wire, 0)
    assert (magic, version, VERSION) == (b"KVT2", 3, 3)
    header = json.loads(wire[12 : 12 + header_len])
    assert header["start_block"] == 1 and header["num_blocks"] == 7
    assert header["chunk_blocks"] == 3 and header["bytes_per_block"] == block_bytes
    pos, lo, sizes = 12 + header_len, 0, []
    while True:
        (n,) = struct.unpack_from("<I", wire, pos)
        pos += 4
        if n == 0:
            break
        size = n * block_bytes
        chunk = memoryview(wire)[pos : pos + size]
        (checksum,) = struct.unpack_from("<Q", wire, pos + size)
        assert checksum == xxhash.xxh3_64_intdigest(chunk, seed=lo)
        # K [layers, kv_heads, n * 16, head_dim] then V, of blocks [1 + lo, 1 + lo + n).
        shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, n * BLOCK_SIZE, LAYOUT.head_dim)
        got = torch.frombuffer(bytearray(chunk), dtype=torch.float16)
        t0, t1 = (1 + lo) * BLOCK_SIZE, (1 + lo + n) * BLOCK_SIZE
        assert torch.equal(got[: got.numel() // 2].view(shape), k[:, :, t0:t1])
        assert torch.equal(got[got.numel() // 2 :].view(shape), v[:, :, t0:t1])
        pos += size + 8
        lo += n
        sizes.append(n)
    assert sizes == [3, 3, 1] and pos == len(wire)


@pytest.mark.parametrize("direct_send", [True, False])
@pytest.mark.parametrize("direct_receive", [True, False])
async def test_transport_fallbacks_move_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch, direct_send: bool, direct_receive: bool
) -> None:
    """Plain TCP sends with `sock_sendall` and receives with scatter reads; TLS (or no socket)
    goes through the asyncio transport on either side. Every combination gives the same run."""
    if not direct_send:
        monkeypatch.setattr(t2_serve, "_direct_socket", lambda request: None)
    if not direct_receive:
        monkeypatch.setattr(BodyReader, "_read_directly", lambda self: None)
    cache = make_cache()
    k, v = store(cache, KEY_A, TOKENS)
    app = web.Application()
    app.add_routes(
        peer_routes(CacheBlockSource(cache), SECRET, chunk_bytes=3 * LAYOUT.bytes_per_block)
    )
    url, runner = await start_app(app)
    try:
        fetcher = PeerFetcher(SECRET, EmbeddedHintIndex(), "me")
        run = await fetcher.fetch_from(url, KEY_A, TOKENS, 2, 8)
    finally:
        await runner.cleanup()
    assert run.num_blocks == 6 and not run.partial
    full = (LAYOUT.num_layers, LAYOUT.num_kv_heads, run.capacity_blocks * BLOCK_SIZE, -1)
    got_k = torch.frombuffer(run.k, dtype=torch.float16).view(full)
    got_v = torch.frombuffer(run.v, dtype=torch.float16).view(full)
    lo, hi = 2 * BLOCK_SIZE, 8 * BLOCK_SIZE
    assert torch.equal(got_k, k[:, :, lo:hi]) and torch.equal(got_v, v[:, :, lo:hi])
