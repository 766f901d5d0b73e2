"""The T2 fetcher's in-place HTTP body receiver (`fleet._receive.BodyReader`), fed by hand in
arbitrary splits: chunk framing anywhere in a read, payload straight into the caller's views or
via the staging buffer, Content-Length bodies, truncation and malformed responses."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvfleet_runtime.fleet._receive import BodyReader


def chunked(payload: bytes, rng: random.Random) -> bytes:
    out = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n"]
    pos = 0
    while pos < len(payload):
        n = rng.randint(1, 3000)
        part = payload[pos : pos + n]
        out.append(b"%x;ext=1\r\n" % len(part) + part + b"\r\n")
        pos += n
    out.append(b"0\r\nTrailer: x\r\n\r\n")
    return b"".join(out)


def feed(reader: BodyReader, wire: bytes, rng: random.Random, max_piece: int = 700) -> None:
    pos = 0
    while pos < len(wire):
        buf = reader.get_buffer(-1)
        n = min(len(buf), rng.randint(1, max_piece), len(wire) - pos)
        buf[:n] = wire[pos : pos + n]
        reader.buffer_updated(n)
        pos += n


@pytest.mark.parametrize("seed", range(5))
async def test_chunked_body_in_any_split_lands_exactly(seed: int) -> None:
    rng = random.Random(seed)
    payload = rng.randbytes(20_000)
    sizes = [1, 4, 5000, 3, 8000, 6987]
    assert sum(sizes) == len(payload) - 5
    reader = BodyReader(asyncio.get_running_loop())
    views = [memoryview(bytearray(n)) for n in sizes]
    if seed % 2:  # the consumer waits first: bytes go straight into its views
        task = asyncio.ensure_future(reader.into_all(views))
        await asyncio.sleep(0)
        feed(reader, chunked(payload, rng), rng)
        await task
    else:  # everything arrives first: from the staging buffer
        feed(reader, chunked(payload, rng), rng)
        await reader.into_all(views)
    status, headers = reader.head.result()
    assert status == 200 and headers["x-a"] == "b"
    assert b"".join(bytes(v) for v in views) == payload[:-5]
    assert await reader.exactly(5) == payload[-5:]
    with pytest.raises(asyncio.IncompleteReadError):
        await reader.exactly(1)


async def test_content_length_body_and_truncation() -> None:
    rng = random.Random(7)
    reader = BodyReader(asyncio.get_running_loop())
    feed(reader, b"HTTP/1.1 404 Not Found\r\nContent-Length: 10\r\n\r\n0123456", rng)
    assert reader.head.result()[0] == 404
    assert await reader.exactly(4) == b"0123"
    task = asyncio.ensure_future(reader.exactly(6))
    await asyncio.sleep(0)
    reader.connection_lost(None)  # the peer went away 3 bytes short
    with pytest.raises(asyncio.IncompleteReadError):
        await task


async def test_malformed_response_fails_the_head() -> None:
    reader = BodyReader(asyncio.get_running_loop())
    feed(reader, b"SPDY/9 what\r\n\r\n", random.Random(1))
    with pytest.raises(ValueError, match="status line"):
        await reader.head
    reader = BodyReader(asyncio.get_running_loop())
    feed(reader, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", random.Random(1))
    await reader.head
    with pytest.raises(asyncio.IncompleteReadError):
        await reader.exactly(1)
