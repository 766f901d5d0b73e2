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
from kvfleet_runtime.wire import ASSERTION_HEADER, HELD_PATH, T2_PATH, TENANT_HEADER
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


NON_UTF8_VALUES = [b"\xff", b"a\x80b", b"\xc3\x28", b"\xed\xa0\x80", b"\xf0\x28\x8c\x28",
                   b"\xfe\xff", "caf\u00e9 \u00b2\u0663\uff11".encode(), "\u2028".encode()]
"""Header values that are not UTF-8 (bytes 0x80-0xff alone, a truncated sequence, an encoded
surrogate, a BOM), and UTF-8 that is not ASCII (Unicode digits, a line separator)."""
UNICODE_DIGITS = ["\u00b2", "\u0663", "\uff11", "\u0967", "\U0001d7d9", "1\u00b2"]
EXPECT_VALUES = [b"200-ok", b"100-continue, 200-ok", b"100-Continue", b"\xff", b"x" * 200,
                 b"100-continue;q=1", b" ", "\u00b2".encode()]


def header_cases(valid: bytes, credential: Callable[[str], bytes] | None = None) -> list[bytes]:
    """Issue 44: every header of `valid` with each value of `NON_UTF8_VALUES` as its value and
    appended to its value (and as a header of its own), `Expect` values, and, with `credential`
    (a digit string -> the request's credential header line), credentials whose digit fields
    are Unicode digits."""
    head, _, body = valid.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    out = []
    for i in range(1, len(lines)):
        name = lines[i].partition(b":")[0]
        if name.lower() == b"content-length":
            continue  # a length that is not a number is the parser's refusal, tested elsewhere
        for value in NON_UTF8_VALUES:  # the value replaced, and the bytes inside the value
            for line in (name + b": " + value, lines[i] + value):
                changed = [*lines[:i], line, *lines[i + 1:]]
                out.append(b"\r\n".join(changed) + b"\r\n\r\n" + body)
    for value in NON_UTF8_VALUES:
        out.append(b"\r\n".join([*lines, b"X-Fuzz: " + value]) + b"\r\n\r\n" + body)
    for value in EXPECT_VALUES:
        out.append(b"\r\n".join([*lines, b"Expect: " + value]) + b"\r\n\r\n" + body)
    if credential is not None:
        for digits in UNICODE_DIGITS:
            line = credential(digits * 10)
            name = line.partition(b":")[0].lower()
            kept = [ln for ln in lines if ln.partition(b":")[0].lower() != name]
            out.append(b"\r\n".join([*kept, line]) + b"\r\n\r\n" + body)
    return out


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


def fuzz(port: int, valid: list[bytes], ok: Callable[[], bool], allowed_ok: set[int],
         extra: list[bytes] | None = None) -> int:
    """Run the cases (the parser's known refusals, `extra`, then `CASES_PER_SERVER` mutations);
    returns how many got an answer. Fails on the first broken rule."""
    handler = _Lines()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    rng = random.Random(SEED)
    gens = [mutations(v, rng) for v in valid]
    known = list(malformed(valid[0].split(b" ")[1].decode()).values()) + list(extra or [])
    answered = 0
    try:
        for i in range(len(known) + CASES_PER_SERVER):
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

    def assertion(digits: str) -> bytes:  # the expiry field in Unicode digits
        value = headers[ASSERTION_HEADER].split(".")
        return f"{ASSERTION_HEADER}: v1.{digits}.{'.'.join(value[2:])}".encode()

    # assertions are single-use: a replayed one is a 401 in the envelope, which is fine here
    extra = header_cases(valid[0], assertion) + header_cases(valid[1])
    assert fuzz(port, valid, ok, {200}, extra) > CASES_PER_SERVER // 2


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

        def credential(digits: str) -> bytes:
            mac = peer_token(SECRET, "tenant-a").rsplit(".", 1)[1]
            return f"Authorization: Bearer v2.{digits}.{mac}".encode()

        extra = header_cases(held, credential) + header_cases(blocks)
        assert fuzz(port, [held, blocks], ok, {200}, extra) > CASES_PER_SERVER // 2
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
        def api_key(digits: str) -> bytes:
            return f"Authorization: Bearer sk-{digits}".encode()

        extra = header_cases(valid[0], api_key) + header_cases(valid[2])
        assert fuzz(port, valid, ok, {200}, extra) > CASES_PER_SERVER // 2
    finally:
        stop()
        stop_fake()


# ---- streams cut at every byte offset (issue 44 item 5) -------------------------------------

LINE_ENDS = [b"\n", b"\r\n", b"\r"]


def random_stream(rng: random.Random) -> tuple[list[bytes], int]:
    """SSE events a replica might send (role chunk, tokens with any text, comments, every line
    end the spec allows) and how many bytes of them lead up to the end of the first token."""
    end = rng.choice(LINE_ENDS)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    events = [b"data: " + json.dumps(role).encode() + end + end]
    first_token_end = 0
    for i in range(rng.randint(2, 6)):
        if rng.random() < 0.2:
            events.append(b": keep-alive" + end + end)
        text = "".join(rng.choice(["a", " ", "é", "\n", "\u2028", "{", "\"", "data: x"])
                       for _ in range(rng.randint(1, 12)))
        token = {"id": f"c{i}", "object": "text_completion",
                 "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        end = rng.choice(LINE_ENDS)
        events.append(b"data: " + json.dumps(token).encode() + end + end)
        if not first_token_end:
            first_token_end = sum(map(len, events))
    return events, first_token_end


def test_fuzz_the_routers_relay_of_streams_cut_anywhere() -> None:
    """A replica that writes a random stream in random pieces and dies at a random byte after
    its first token: the client gets exactly the whole events before the cut, then the
    router's error event, never a partial one."""
    from kvfleet_runtime.router._sse import SseEvents, data_lines
    from kvfleet_runtime.wire import LOAD_PATH

    rng = random.Random(SEED)
    plans: dict[int, tuple[list[bytes], int]] = {}

    def replica_app() -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            events, cut = plans[(await request.json())["seed"]]
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            data = b"".join(events)[:cut]
            pos = 0
            while pos < len(data):
                step = rng.randint(1, 40)
                await resp.write(data[pos:pos + step])
                pos += step
            await asyncio.sleep(0.01)
            assert request.transport is not None
            request.transport.close()  # the replica dies mid-answer
            return resp

        async def load(request: web.Request) -> web.StreamResponse:
            return web.json_response({"ready": True})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get(LOAD_PATH, load)
        return app

    replica_port, stop_replica = _serve_in_thread(replica_app)
    holder: dict[str, object] = {"state": RouterState(
        view=FleetView(static_replicas={"r0": f"http://127.0.0.1:{replica_port}"}),
        keys=parse_api_keys({"tenants": {"acme": ["sk-acme"]}}), poll_interval_s=0.2)}
    port, stop = _serve_in_thread(lambda: create_router_app(holder["state"]))  # type: ignore[arg-type]
    try:
        for case in range(CASES_PER_SERVER):
            events, first_token_end = random_stream(rng)
            total = sum(map(len, events))
            # from one byte past the first token's event: an event that ends in a lone CR is
            # whole only once the next byte is seen (a cut right there is before the token)
            cut = rng.randint(first_token_end + 1, total + 1)
            plans[case] = (events, cut)
            body = json.dumps({"prompt": "hi", "stream": True, "seed": case}).encode()
            data = request("POST", "/v1/completions", body, {
                "Authorization": "Bearer sk-acme", "Content-Type": "application/json",
                "Connection": "close"})
            deadline = time.monotonic() + 30
            while True:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                    conn.sendall(data)
                    raw = b""
                    while chunk := conn.recv(65536):
                        raw += chunk
                if b" 503 " not in raw.split(b"\r\n", 1)[0] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)  # the router has not seen its replica ready yet
            head, _, chunked = raw.partition(b"\r\n\r\n")
            assert b" 200 " in head.split(b"\r\n", 1)[0], raw[:300]
            got = _unchunk(chunked)
            framer = SseEvents()
            received = framer.feed(got)
            assert framer.partial == b"", (case, cut, framer.partial)
            whole, pos = [], 0
            for event in events:
                if pos + len(event) > cut:
                    break
                whole.append(event)
                pos += len(event)
            # a whole event ending in a lone CR at the cut is held for the byte that says it
            # is not a CRLF: it is dropped with the cut
            if received[:-1] != whole:
                assert whole[-1].endswith(b"\r") and received[:-1] == whole[:-1], (case, cut)
            error = json.loads(data_lines(received[-1])[0])
            assert error["error"]["code"] == "upstream_failed", received[-1]
    finally:
        stop()
        stop_replica()


def _unchunk(data: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (as far as it goes)."""
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return out
