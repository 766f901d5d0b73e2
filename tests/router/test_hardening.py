"""The router's HTTP layer under hostile input and broken replicas (issue 25), on loopback: raw
bytes from the client side, fake replicas that stall, cut or answer HTML on the other."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from kvfleet_runtime.affinity import rendezvous_top_k
from tests.rawhttp import RawAnswer, cut_while_sending, exchange, malformed, request
from tests.router.conftest import FakeReplica, RouterHandle, StartRouter

NOT_GZIP = b"this is not a gzip stream at all"
AUTH = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}


def port(router: RouterHandle) -> int:
    return int(urllib.parse.urlsplit(router.url).port or 0)


async def raw(router: RouterHandle, data: bytes | list[bytes], **kw: float) -> RawAnswer | None:
    return await asyncio.to_thread(exchange, port(router), data, **kw)


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.ERROR, record.getMessage()
        assert len(record.getMessage()) < 1000, record.getMessage()[:200]


async def still_serving(router: RouterHandle) -> None:
    status, _, body = await router.post({"prompt": "hi"})
    assert status == 200, body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_body_with_a_bad_content_encoding_is_a_400_in_the_envelope(
    replicas: list[FakeReplica], start_router: StartRouter, caplog: pytest.LogCaptureFixture,
    path: str, encoding: str
) -> None:
    # Fails before issue 25: 500 internal_error and an ERROR traceback.
    caplog.set_level(logging.DEBUG)
    router = await start_router(replicas)
    answer = await raw(router, request("POST", path, NOT_GZIP,
                                       {**AUTH, "Content-Encoding": encoding}))
    assert answer is not None and answer.status == 400, answer
    assert answer.error["code"] == "invalid_body_encoding"
    assert sum(len(r.seen) for r in replicas) == 0
    no_traceback(caplog)
    await still_serving(router)


async def test_bad_json_after_a_good_encoding_is_still_named(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    import gzip
    router = await start_router(replicas)
    answer = await raw(router, request("POST", "/v1/completions", gzip.compress(b"{nope"),
                                       {**AUTH, "Content-Encoding": "gzip"}))
    assert answer is not None and answer.status == 400 and json.loads(answer.body)
    assert answer.error["code"] == "invalid_json"


# ---- config input (items 5 and 6) ------------------------------------------------------------

DEEP = "replicas: " + "[" * 5000 + "]" * 5000 + "\n"
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))


@pytest.mark.parametrize(("text", "why"), [
    (DEEP, "nests deeper than 32 levels"), (LAUGHS, "aliases"),
    # issue 44: PyYAML's ReaderError escaped the parser and killed the poll task (8a5e244)
    ("replicas: []\nx: \x07\n", "unacceptable character #x0007"),
    (b"replicas: []\nx: \xc3\x28\n", "invalid continuation byte"),
    (b'{"replicas": [], "x": "\xff"}', "invalid start byte")])
async def test_a_hostile_fleet_config_is_refused_in_one_line_and_the_next_valid_one_applies(
    replicas: list[FakeReplica], start_router: StartRouter, tmp_path: Path,
    caplog: pytest.LogCaptureFixture, text: str | bytes, why: str
) -> None:
    # Fails before issue 25: RecursionError kills the router's poll task (later files are never
    # applied, /readyz says nothing); the laughs stall the event loop and log ~2 GB.
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "fleet.yaml"
    reps = [{"name": r.name, "url": r.url} for r in replicas]
    path.write_text(json.dumps({"replicas": reps, "home_sets": {"acme": ["r2"]}, "generation": 1}))
    router = await start_router(replicas[:1], config_path=path)
    await router.refresh()
    path.write_bytes(text if isinstance(text, bytes) else text.encode())

    async def readyz() -> dict[str, Any]:
        async with router.session.get(router.url + "/readyz") as r:
            return dict(await r.json())

    for _ in range(200):
        if (await readyz())["config_error"]:
            break
        await asyncio.sleep(0.05)
    reason = (await readyz())["config_error"]
    assert reason and why in reason and "\n" not in reason and len(reason) <= 500
    refusals = [r for r in caplog.records
                if "fleet config rejected" in r.getMessage() and r.levelno >= logging.INFO]
    assert len(refusals) == 1 and len(refusals[0].getMessage()) < 1000
    status, _, body = await router.post({"prompt": "x"})
    assert status == 200 and body["replica"] == "r2"  # the last good config routes
    path.write_text(json.dumps({"replicas": reps, "home_sets": {"acme": ["r4"]}, "generation": 2}))
    for _ in range(200):
        config = router.state.view.config
        if config is not None and config.generation == 2:
            break
        await asyncio.sleep(0.05)
    _, _, body = await router.post({"prompt": "x"})
    assert body["replica"] == "r4" and (await readyz())["config_error"] is None


# ---- aiohttp's parser refusals (item 8) ------------------------------------------------------

@pytest.mark.parametrize("name", sorted(malformed("/v1/completions")))
async def test_requests_the_http_parser_refuses_are_4xx_in_the_envelope_and_one_log_line(
    replicas: list[FakeReplica], start_router: StartRouter, caplog: pytest.LogCaptureFixture,
    name: str
) -> None:
    # Fails before issue 25: plain-text 400s and an ERROR traceback for each.
    caplog.set_level(logging.DEBUG)
    router = await start_router(replicas)
    caplog.clear()
    answer = await raw(router, malformed("/v1/completions")[name])
    assert answer is not None and 400 <= answer.status < 500, answer
    assert answer.error["code"] == "malformed_request"
    no_traceback(caplog)
    own = [r.getMessage() for r in caplog.records if r.name != "aiohttp.access"]
    assert len(own) <= 1 and all("\n" not in m and len(m) < 400 for m in own), own
    await still_serving(router)


# ---- deadlines (item 7) ----------------------------------------------------------------------

async def test_slow_headers_are_cut_at_the_head_deadline(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    # Fails before issue 25: slow heads stayed open (aiohttp's keep-alive timer is an hour).
    router = await start_router(replicas, state={"header_read_timeout_s": 1.0})
    head = request("POST", "/v1/completions", b"{}", AUTH)
    pieces = [head[i:i + 1] for i in range(len(head) - 4)]
    # ~16 s to send it all at 0.2 s a byte: the 1 s deadline cuts it long before
    assert await asyncio.to_thread(cut_while_sending, port(router), pieces, 0.2)
    await still_serving(router)


async def test_a_body_that_never_arrives_is_408_at_the_deadline(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    router = await start_router(replicas, state={"body_read_timeout_s": 0.5})
    head = request("POST", "/v1/completions", b"", {**AUTH, "Content-Length": "1000"},
                   content_length=False)
    answer = await raw(router, [head, b'{"prompt": '])
    assert answer is not None and answer.status == 408 and answer.error["code"] == "body_timeout"


# ---- replicas that take a request and fail it (items 3, 4; deliverable 4) --------------------

FAST = {"upstream_first_byte_timeout_s": 0.5, "replica_backoff_s": 60.0}
NAMES = [f"r{i}" for i in range(5)]


def home_of(tenant: str) -> str:
    return rendezvous_top_k(tenant, NAMES, 3)[0]


async def sse_events(router: RouterHandle, body: dict[str, Any]) -> tuple[int, list[Any]]:
    async with router.session.post(router.url + "/v1/completions", json=body,
                                   headers={"Authorization": "Bearer sk-acme"}) as r:
        text = (await r.read()).decode()
    events = [line[5:].strip() for line in text.split("\n") if line.startswith("data:")]
    return r.status, [e if e == "[DONE]" else json.loads(e) for e in events]


@pytest.mark.parametrize("fault", ["stall", "html_500"])
async def test_a_replica_that_takes_the_request_and_fails_it_is_failed_over_and_backed_off(
    replicas: list[FakeReplica], start_router: StartRouter, fault: str
) -> None:
    # Fails before issue 25: "stall" held the request until the client gave up (no time to
    # first byte bound) and the replica stayed ready; "html_500" passed the HTML page through.
    home = next(r for r in replicas if r.name == home_of("acme"))
    home.fault = fault
    router = await start_router(replicas, state=FAST)
    await router.refresh()
    status, _, body = await router.post({"prompt": "hi"})
    assert status == 200 and body["replica"] != home.name, body
    await router.refresh()  # its load report still says ready: the back-off holds it out
    assert not next(x for x in router.state.view.loads() if x.name == home.name).ready
    seen = len(home.seen)
    status, _, body = await router.post({"prompt": "hi"})
    assert status == 200 and body["replica"] != home.name and len(home.seen) == seen


async def test_when_every_replica_answers_html_the_client_gets_the_envelope(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    for r in replicas:
        r.fault = "html_500"
    router = await start_router(replicas, state=FAST)
    await router.refresh()
    status, _, body = await router.post({"prompt": "hi"})
    assert status == 503 and body["error"]["code"] == "no_replica"
    assert "not JSON" in body["error"]["message"]


@pytest.mark.parametrize("fault", ["sse_stall", "cut_before_token"])
async def test_a_stream_that_delivered_no_token_fails_over(
    replicas: list[FakeReplica], start_router: StartRouter, fault: str
) -> None:
    # Fails before issue 25: the replica's 200 and role chunk went straight to the client, so
    # the stream stalled ("sse_stall") or was cut with no token and no error.
    home = next(r for r in replicas if r.name == home_of("acme"))
    home.fault = fault
    router = await start_router(replicas, state=FAST)
    await router.refresh()
    status, events = await sse_events(router, {"prompt": "hi", "stream": True})
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 6
    assert all("error" not in e for e in events if e != "[DONE]")


async def test_a_stream_cut_after_a_token_ends_with_an_error_event(
    replicas: list[FakeReplica], start_router: StartRouter
) -> None:
    # Fails before issue 25: the router closed the client's connection with no error.
    home = next(r for r in replicas if r.name == home_of("acme"))
    home.fault = "cut_after_token"
    router = await start_router(replicas, state=FAST)
    await router.refresh()
    status, events = await sse_events(router, {"prompt": "hi", "stream": True})
    assert status == 200
    assert [e["choices"][0].get("text") for e in events[1:3]] == ["he", "llo"]
    last = events[-1]
    assert set(last) == {"error"} and last["error"]["code"] == "upstream_failed"
    assert last["error"]["type"] == "server_error" and "mid-stream" in last["error"]["message"]
