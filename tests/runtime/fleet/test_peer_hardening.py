"""The peer routes (`/kv/v1/blocks`, `/kv/v1/held`) under hostile input from a peer holding a
valid credential (issue 25), on loopback: bad encodings, slow bodies, all in the envelope."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from kvfleet_runtime.api import AppRunner, ListenerLimits, error_middleware, handler_args
from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache
from kvfleet_runtime.fleet import CacheBlockSource, PeerSecrets, peer_routes, peer_token
from kvfleet_runtime.wire import HELD_PATH, T2_PATH, TENANT_HEADER
from tests.rawhttp import RawAnswer, cut_while_sending, exchange, malformed, request
from tests.runtime.fleet.conftest import REDIS_SERVER, RedisProcess
from tests.support import free_port

SECRET = b"peer-hardening-secret"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")


def peer_headers() -> dict[str, str]:
    """A valid peer's headers, the credential minted now (credentials expire: one minted at
    import would not outlive a long test session)."""
    return {TENANT_HEADER: "tenant-a", "Content-Type": "application/json",
            "Authorization": "Bearer " + peer_token(SECRET, "tenant-a")}
log = logging.getLogger(__name__)


@dataclass
class Peer:
    port: int


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    cache = PrefixCache(CacheTuning(num_t0_blocks=16, admit_min_sightings=1), LAYOUT,
                        clock=time.monotonic)
    app = web.Application(middlewares=[error_middleware(log)],
                          handler_args=handler_args(ListenerLimits(header_timeout_s=1.0)))
    app.add_routes(peer_routes(CacheBlockSource(cache), SECRET, held=lambda hashes, tenant: 0,
                               body_timeout_s=0.5))
    runner = AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield Peer(port)
    await runner.cleanup()


async def raw(peer: Peer, data: bytes | list[bytes], **kw: float) -> RawAnswer | None:
    return await asyncio.to_thread(exchange, peer.port, data, **kw)


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.ERROR, record.getMessage()


@pytest.mark.parametrize("path", [T2_PATH, HELD_PATH])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_peer_body_with_a_bad_content_encoding_is_a_400_in_the_envelope(
    peer: Peer, caplog: pytest.LogCaptureFixture, path: str, encoding: str
) -> None:
    # Fails before issue 25: 500 internal_error and an ERROR traceback.
    caplog.set_level(logging.DEBUG)
    answer = await raw(peer, request("POST", path, b"not a gzip stream",
                                     {**peer_headers(), "Content-Encoding": encoding}))
    assert answer is not None and answer.status == 400, answer
    assert answer.error["code"] == "invalid_body_encoding"
    no_traceback(caplog)
    answer = await raw(peer, request("POST", HELD_PATH, b'{"block_hashes": ["ab"]}',
                                     peer_headers()))
    assert answer is not None and answer.status == 200 and answer.json() == {"leading_blocks": 0}


@pytest.mark.parametrize("name", sorted(malformed(T2_PATH)))
async def test_requests_the_http_parser_refuses_are_4xx_in_the_envelope_on_the_peer_port(
    peer: Peer, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    # Fails before issue 25: plain-text 400s and an ERROR traceback for each.
    caplog.set_level(logging.DEBUG)
    answer = await raw(peer, malformed(T2_PATH)[name])
    assert answer is not None and 400 <= answer.status < 500, answer
    assert answer.error["code"] == "malformed_request"
    no_traceback(caplog)
    own = [r.getMessage() for r in caplog.records if r.name != "aiohttp.access"]
    assert len(own) <= 1 and all("\n" not in m and len(m) < 400 for m in own), own


# ---- deadlines (item 7) ----------------------------------------------------------------------

@pytest.mark.parametrize("path", [T2_PATH, HELD_PATH])
async def test_a_peer_body_that_never_arrives_is_408_at_the_deadline(
    peer: Peer, path: str
) -> None:
    # Fails before issue 25: a valid peer promising 1,000 bytes and sending 8 held the
    # connection for as long as it liked (no deadline on the peer routes).
    head = request("POST", path, b"", {**peer_headers(), "Content-Length": "1000"},
                   content_length=False)
    answer = await asyncio.wait_for(raw(peer, [head, b'{"key": '], timeout_s=30.0), 30)
    assert answer is not None and answer.status == 408, answer
    assert answer.error["code"] == "body_timeout"


async def test_slow_headers_are_cut_at_the_head_deadline(peer: Peer) -> None:
    # Fails before issue 25: a head sent a byte at a time stayed open indefinitely (aiohttp's
    # default keep-alive timer is an hour). The fixture's head deadline is 1 s.
    head = request("GET", "/healthz")
    pieces = [head[i:i + 1] for i in range(len(head) - 4)]
    # ~8 s to send it all at 0.2 s a byte: the 1 s deadline cuts it long before
    assert await asyncio.to_thread(cut_while_sending, peer.port, pieces, 0.2)


# ---- the router's Redis password (deliverable 5) ---------------------------------------------

async def test_the_router_reaches_a_password_protected_redis_with_the_password_from_a_file(
    tmp_path: Path
) -> None:
    # Issue 25: the router's Redis password by file (or environment), never in argv; against a
    # real redis-server with requirepass.
    from kvfleet_runtime.cli.router import redis_url_from
    from kvfleet_runtime.fleet.hint_index import RedisHintIndex

    if not Path(REDIS_SERVER).exists():
        pytest.skip("redis-server is not installed")
    server = RedisProcess(free_port(), tmp_path, password="from-a-file")
    server.start()
    try:
        secret = tmp_path / "password"
        secret.write_text("from-a-file\n")
        url = redis_url_from(f"redis://127.0.0.1:{server.port}/0",
                             {"KVFLEET_REDIS_PASSWORD_FILE": str(secret)})
        assert url is not None and "from-a-file" in url
        index = RedisHintIndex.from_url(url)
        try:
            await index.publish("r0", [b"\x01" * 16])
            assert await index.lookup_runs([b"\x01" * 16]) == {"r0": 1}
        finally:
            await index.close()
    finally:
        server.stop()


# ---- peer credentials expire and rotate (deliverable 5) --------------------------------------

def held_headers(secret: bytes, tenant: str = "tenant-a", **kw: float) -> dict[str, str]:
    return {TENANT_HEADER: tenant, "Content-Type": "application/json",
            "Authorization": "Bearer " + peer_token(secret, tenant, **kw)}


HELD_BODY = b'{"block_hashes": ["ab"]}'


async def test_expired_long_lived_and_old_style_peer_credentials_are_refused(peer: Peer) -> None:
    # Fails before issue 25: the credential was a fixed HMAC per tenant that never expired.
    import hashlib
    import hmac as hmac_module
    now = time.time()
    old_style = hmac_module.new(SECRET, b"kvfleet-t2-v1\x00tenant-a", hashlib.sha256).hexdigest()
    for headers in (held_headers(SECRET, now_s=now - 120),   # expired a minute ago
                    held_headers(SECRET, ttl_s=3600),        # claims an hour
                    {**peer_headers(), "Authorization": "Bearer " + old_style}):
        answer = await raw(peer, request("POST", HELD_PATH, HELD_BODY, headers))
        assert answer is not None and answer.status == 401, answer
        assert answer.error["code"] == "invalid_peer_credential"
    answer = await raw(peer, request("POST", HELD_PATH, HELD_BODY, held_headers(SECRET)))
    assert answer is not None and answer.status == 200


async def test_peer_secrets_rotate_without_dropping_a_request_in_flight(tmp_path: Path) -> None:
    old, new = b"old-peer-secret", b"new-peer-secret"
    path = tmp_path / "token"
    path.write_bytes(old + b"\n")
    secrets = PeerSecrets.from_file(path)
    assert secrets is not None
    cache = PrefixCache(CacheTuning(num_t0_blocks=16, admit_min_sightings=1), LAYOUT,
                        clock=time.monotonic)
    app = web.Application(middlewares=[error_middleware(log)])
    app.add_routes(peer_routes(CacheBlockSource(cache), secrets, held=lambda hashes, t: 0))
    runner = AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    async def status(secret: bytes) -> int:
        got = await asyncio.to_thread(exchange, port, request("POST", HELD_PATH, HELD_BODY,
                                                               held_headers(secret)))
        assert got is not None
        return got.status

    try:
        assert (await status(old), await status(new)) == (200, 401)
        path.write_bytes(old + b"\n" + new + b"\n")  # step 1: accept both, sign with the old
        assert secrets.reload() and secrets.signing == old
        assert (await status(old), await status(new)) == (200, 200)
        path.write_bytes(new + b"\n" + old + b"\n")  # step 2: sign with the new
        assert secrets.reload() and secrets.signing == new
        # A request authenticated under the old secret, its body still on the way when the old
        # secret is dropped (step 3): it completes.
        head = request("POST", HELD_PATH, b"", {**held_headers(old),
                                                 "Content-Length": str(len(HELD_BODY))},
                       content_length=False)

        def in_flight() -> RawAnswer | None:
            import socket
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                conn.sendall(head)
                time.sleep(0.3)
                path.write_bytes(new + b"\n")
                assert secrets.reload()
                conn.sendall(HELD_BODY)
                from tests.rawhttp import read_answer
                return read_answer(conn)

        answer = await asyncio.to_thread(in_flight)
        assert answer is not None and answer.status == 200, answer
        assert (await status(old), await status(new)) == (401, 200)
    finally:
        await runner.cleanup()


# ---- credential fields with Unicode digits and bytes that are not UTF-8 (issue 44 item 1) ----

def _with_expiry(expiry: str) -> str:
    """A credential whose expiry field is `expiry`, with a well-formed MAC."""
    return "Bearer v2." + expiry + "." + peer_token(SECRET, "tenant-a").rsplit(".", 1)[1]


UNICODE_DIGIT_CREDENTIALS = {
    "superscript_two": "Bearer v2.\u00b2.00",  # the curl
    "superscript_expiry_real_mac": _with_expiry("\u00b2" * 10),
    "arabic_indic": _with_expiry("\u0663" * 10),
    "fullwidth": _with_expiry("\uff11" * 10),
    "devanagari": _with_expiry("\u0967\u0968\u0969\u096a\u096b\u096c\u096d\u096e\u096f\u0966"),
    "mathematical_bold": _with_expiry("\U0001d7d9" * 10),
    "mixed_ascii_and_fullwidth": _with_expiry(str(int(time.time()) + 30)[:-1] + "\uff10"),
    "not_utf8_expiry": _with_expiry("17\udcff"),
    "not_utf8_mac": "Bearer v2." + str(int(time.time()) + 30) + "." + "\udcff" * 64,
    "uppercase_mac": "Bearer v2." + peer_token(SECRET, "tenant-a").split(".", 1)[1].upper(),
}


@pytest.mark.parametrize("name", sorted(UNICODE_DIGIT_CREDENTIALS))
@pytest.mark.parametrize("path", [HELD_PATH, T2_PATH])
async def test_a_credential_with_unicode_digits_or_undecodable_bytes_is_a_401(
    peer: Peer, caplog: pytest.LogCaptureFixture, name: str, path: str
) -> None:
    # Fails on 8a5e244 for the Unicode digits: `str.isdigit()` took them, then `int()` raised
    # (500 internal_error and a traceback), or read a full-width expiry as a number.
    caplog.set_level(logging.DEBUG)
    value = UNICODE_DIGIT_CREDENTIALS[name]
    wire = value.encode("utf-8", "surrogateescape").decode("latin-1")  # the raw bytes
    answer = await raw(peer, request("POST", path, HELD_BODY, {
        **peer_headers(), "Authorization": wire}))
    assert answer is not None and answer.status == 401, answer
    assert answer.error["code"] == "invalid_peer_credential"
    no_traceback(caplog)


def test_the_credential_parser_takes_only_ascii_digits_and_lowercase_hex() -> None:
    from kvfleet_runtime.fleet.t2_protocol import parse_peer_token
    token = peer_token(SECRET, "tenant-a", now_s=1000.0, ttl_s=60)
    assert parse_peer_token("Bearer " + token) == (1060, token.rsplit(".", 1)[1])
    assert parse_peer_token("bearer  " + token) == (1060, token.rsplit(".", 1)[1])
    for bad in (None, "", "Bearer", token, "Basic " + token, "Bearer v1.1060." + "a" * 64,
                "Bearer v2.1060." + "a" * 63, "Bearer v2.1060." + "g" * 64,
                "Bearer v2.-1." + "a" * 64, "Bearer v2. 1060." + "a" * 64,
                "Bearer v2.1060." + "a" * 64 + ".x", "Bearer v2." + "9" * 13 + "." + "a" * 64,
                "Bearer v2.\u0661\u0660\u0666\u0660." + "a" * 64):
        assert parse_peer_token(bad) is None, bad
