"""Socket-level fuzzing of kvfleet's HTTP layer (issue 25): the router, a replica and the peer
port, each on loopback, driven with malformed requests built from a fixed seed (a bounded count
per server: the known parser refusals plus random mutations of valid requests: bytes flipped,
cut, duplicated, headers swapped, framing mixed, encodings lied about).

Asserted for every request: no 5xx; every answer with a body is OpenAI's error envelope (or the
route's own success); at most 2 log lines and 1,000 characters of log per request, no traceback;
and the server answers a valid request afterwards. The replica here is the real replica app over
a tiny checkpoint (the server tests' fixture); the router proxies to fake replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from aiohttp import web

from kvfleet_runtime.affinity import parse_api_keys
from kvfleet_runtime.api import AppRunner, ListenerLimits, error_middleware, handler_args
from kvfleet_runtime.cache import CacheTuning, KVLayout, PrefixCache
from kvfleet_runtime.fleet import CacheBlockSource, peer_routes, peer_token
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.router import RouterState, create_router_app
from kvfleet_runtime.wire import HELD_PATH, T2_PATH, TENANT_HEADER
from tests.rawhttp import RawAnswer, malformed, read_answer, request
from tests.router.conftest import FakeReplica
from tests.runtime.server.conftest import (  # noqa: F401 (fixtures: the real replica)
    RunningReplica,
    _one_cpu_thread,
    as_router,
    model_dir,
    running,
)

CASES_PER_SERVER = 60
SEED = 25
MAX_LOG_LINES_PER_REQUEST = 2
MAX_LOG_CHARS_PER_REQUEST = 1000
SECRET = b"fuzz-peer-secret"
log = logging.getLogger(__name__)



def mutations(valid: bytes, rng: random.Random) -> Iterator[bytes]:
    """Malformed variants of one valid request, forever."""
    head, _, body = valid.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    while True:
        kind = rng.randrange(10)
        if kind == 0:  # flip bytes anywhere
            data = bytearray(valid)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            yield bytes(data)
        elif kind == 1:  # cut short, then the client closes
            yield valid[: rng.randrange(1, len(valid))]
        elif kind == 2:  # a header duplicated or dropped
            extra = list(lines)
            i = rng.randrange(1, len(extra))
            extra.insert(i, extra[i]) if rng.random() < 0.5 else extra.pop(i)
            yield b"\r\n".join(extra) + b"\r\n\r\n" + body
        elif kind == 3:  # a lying Content-Length
            wrong = [ln for ln in lines if not ln.lower().startswith(b"content-length")]
            n = rng.choice([0, 1, len(body) - 1, len(body) + 5, 2**31, 2**63])
            yield b"\r\n".join([*wrong, b"Content-Length: %d" % n]) + b"\r\n\r\n" + body
        elif kind == 4:  # chunked framing, possibly broken
            size = rng.choice([b"%x" % len(body), b"ffffffffffffffffff", b"-1",
                               b"1;x=" + b"y" * 9000])
            wrong = [ln for ln in lines if not ln.lower().startswith(b"content-length")]
            yield (b"\r\n".join([*wrong, b"Transfer-Encoding: chunked"]) + b"\r\n\r\n" + size
                   + b"\r\n" + body + b"\r\n0\r\n\r\n")
        elif kind == 5:  # an encoding that the body does not have, or a real one of garbage
            enc = rng.choice([b"gzip", b"deflate", b"br", b"zstd", b"gzip, deflate", b"x" * 50])
            data = gzip.compress(body)[: rng.randrange(1, 30)] if rng.random() < 0.5 else body
            wrong = [ln for ln in lines if not ln.lower().startswith(b"content-length")]
            yield (b"\r\n".join([*wrong, b"Content-Encoding: " + enc,
                                 b"Content-Length: %d" % len(data)]) + b"\r\n\r\n" + data)
        elif kind == 6:  # the body mangled (valid framing)
            data = bytearray(body or b"{}")
            data[rng.randrange(len(data))] = rng.choice(b'{}[]",:\\\x00\xff')
            wrong = [ln for ln in lines if not ln.lower().startswith(b"content-length")]
            yield b"\r\n".join([*wrong, b"Content-Length: %d" % len(data)]) + b"\r\n\r\n" + data
        elif kind == 7:  # a mangled request line
            method, path, _version = [*lines[0].split(b" "), b"", b""][:3]
            line = rng.choice([b"%s %s HTTP/1.1" % (method, b"/" + b"%" * 50),
                               b"%s %s" % (method, path), b"%s %s HTTP/2.0" % (method, path),
                               b"%s\t%s HTTP/1.1" % (method, path), b"PRI * HTTP/2.0"])
            yield b"\r\n".join([line, *lines[1:]]) + b"\r\n\r\n" + body
        elif kind == 8:  # control bytes in a header value or name
            bad = rng.choice([b"X-A: a\rb", b"X-A: \x7f", b"X\x01A: v", b": empty", b"X-A\x00: v"])
            yield b"\r\n".join([lines[0], bad, *lines[1:]]) + b"\r\n\r\n" + body
        else:  # a JSON body that is valid JSON but absurd
            data = rng.choice([b"[" * 40 + b"]" * 40, b'{"prompt": 1e999}', b'"\\ud800"',
                               b'{"prompt": ' + b"9" * 50 + b"}", b"null", b'{"a": ' * 40])
            wrong = [ln for ln in lines if not ln.lower().startswith(b"content-length")]
            yield b"\r\n".join([*wrong, b"Content-Length: %d" % len(data)]) + b"\r\n\r\n" + data


def send(port: int, data: bytes, *, half_close: bool = False) -> RawAnswer | None:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
        with contextlib.suppress(OSError):
            conn.sendall(data)
        if half_close:  # no more is coming: the server must answer or close at once
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
        try:
            return read_answer(conn)
        except (TimeoutError, OSError):
            return None


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.mu = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self.mu:
            self.records.append(record)


def fuzz(port: int, valid: list[bytes], ok: Callable[[], bool], allowed_ok: set[int]) -> int:
    """Run the cases; returns how many got an answer. Fails on the first broken rule."""
    handler = _Lines()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    rng = random.Random(SEED)
    gens = [mutations(v, rng) for v in valid]
    known = list(malformed(valid[0].split(b" ")[1].decode()).values())
    answered = 0
    try:
        for i in range(CASES_PER_SERVER):
            data = known[i] if i < len(known) else next(gens[i % len(gens)])
            with handler.mu:
                handler.records.clear()
            answer = send(port, data)
            time.sleep(0.005)  # let the server finish logging this request
            with handler.mu:
                own = [r for r in handler.records if r.name != "aiohttp.access"]
            text = [r.getMessage() for r in own]
            bad = [logging.Formatter().format(r) for r in own
                   if r.exc_info is not None or r.levelno >= logging.ERROR]
            assert not bad, (data[:200], bad[0][-1500:])
            assert len(own) <= MAX_LOG_LINES_PER_REQUEST, (data[:200], text)
            assert sum(len(t) for t in text) <= MAX_LOG_CHARS_PER_REQUEST, (data[:200], text)
            if answer is None:
                continue  # closed without answering (a cut request): allowed
            answered += 1
            assert answer.status < 500, (data[:200], answer)
            if answer.status not in allowed_ok:
                assert answer.error, (data[:200], answer)
        assert ok(), "the server stopped answering valid requests"
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return answered


# ---- the three servers -----------------------------------------------------------------------

def test_fuzz_the_replica(running: RunningReplica) -> None:  # noqa: F811 (the fixture)
    import urllib.parse
    port = int(urllib.parse.urlsplit(running.base_url).port or 0)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    headers = {**as_router({TENANT_HEADER: "default"}, "POST",
                           running.base_url + "/v1/completions"),
               "Content-Type": "application/json"}
    valid = [request("POST", "/v1/completions", body, headers),
             request("GET", "/v1/models"), request("GET", "/healthz")]

    def ok() -> bool:
        fresh = {**as_router({TENANT_HEADER: "default"}, "POST",
                             running.base_url + "/v1/completions"),
                 "Content-Type": "application/json"}
        answer = send(port, request("POST", "/v1/completions", body, fresh), half_close=False)
        assert answer is not None and answer.status == 200, answer
        return True

    # assertions are single-use: a replayed one is a 401 in the envelope, which is fine here
    assert fuzz(port, valid, ok, {200}) > CASES_PER_SERVER // 2


def _serve_in_thread(make_app: Callable[[], web.Application]) -> tuple[int, Callable[[], None]]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, object] = {}

    def main() -> None:
        asyncio.set_event_loop(loop)
        runner = AppRunner(make_app())
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"] = runner.addresses[0][1]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(30)

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)

    return int(holder["port"]), stop  # type: ignore[call-overload]


def test_fuzz_the_peer_port() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")

    def make() -> web.Application:
        cache = PrefixCache(CacheTuning(num_t0_blocks=16, admit_min_sightings=1), layout,
                            clock=time.monotonic)
        app = web.Application(middlewares=[error_middleware(log)],
                              handler_args=handler_args(ListenerLimits(header_timeout_s=5)))
        app.add_routes(peer_routes(CacheBlockSource(cache), SECRET, held=lambda h, t: 0,
                                   body_timeout_s=2.0))
        return app

    port, stop = _serve_in_thread(make)
    try:
        headers = {TENANT_HEADER: "tenant-a", "Content-Type": "application/json",
                   "Authorization": "Bearer " + peer_token(SECRET, "tenant-a", ttl_s=300)}
        held = request("POST", HELD_PATH, b'{"block_hashes": ["ab", "cd"]}', headers)
        blocks = request("POST", T2_PATH, json.dumps({
            "key": {"tenant_id": "tenant-a", "model_id": "m",
                    "weights_digest": "sha256:" + "a" * 64, "kv_dtype": "float16",
                    "rope_config_hash": "r", "attn_impl_id": "sdpa"},
            "token_ids": list(range(40)), "start_block": 0}).encode(), headers)

        def ok() -> bool:
            answer = send(port, held, half_close=False)
            return answer is not None and answer.status == 200

        assert fuzz(port, [held, blocks], ok, {200}) > CASES_PER_SERVER // 2
    finally:
        stop()


def test_fuzz_the_router(tmp_path: Path) -> None:
    fake = FakeReplica("r0")
    holder: dict[str, object] = {}

    def make() -> web.Application:
        return create_router_app(holder["state"])  # type: ignore[arg-type]

    fake_port, stop_fake = _serve_in_thread(fake.app)
    fake.url = f"http://127.0.0.1:{fake_port}"
    holder["state"] = RouterState(
        view=FleetView(static_replicas={"r0": fake.url}),
        keys=parse_api_keys({"tenants": {"acme": ["sk-acme"]}}), poll_interval_s=0.5,
        body_read_timeout_s=2.0, header_read_timeout_s=5.0)
    port, stop = _serve_in_thread(make)
    try:
        auth = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}
        valid = [request("POST", "/v1/completions", b'{"prompt": "hi"}', auth),
                 request("POST", "/v1/chat/completions",
                         b'{"messages": [{"role": "user", "content": "hi"}]}', auth),
                 request("GET", "/healthz")]

        def ok() -> bool:
            answer = send(port, valid[0], half_close=False)
            return answer is not None and answer.status == 200

        deadline = time.monotonic() + 30
        while not ok():
            assert time.monotonic() < deadline, "the router never saw its replica ready"
            time.sleep(0.1)
        assert fuzz(port, valid, ok, {200}) > CASES_PER_SERVER // 2
    finally:
        stop()
        stop_fake()
