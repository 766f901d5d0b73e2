"""The router's HTTP layer under hostile input and broken replicas (issue 25), on loopback: raw
bytes from the client side, fake replicas that stall, cut or answer HTML on the other."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse

import pytest

from tests.rawhttp import RawAnswer, exchange, request
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
