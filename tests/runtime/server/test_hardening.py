"""The replica's HTTP layer under hostile input, at the socket level (raw bytes on loopback,
issue 25): every refusal is a 4xx in OpenAI's envelope, logged as at most one short line, and the
replica answers the next request."""

from __future__ import annotations

import gzip
import json
import logging
import urllib.parse

import pytest

from tests.rawhttp import exchange, request

from .conftest import RunningReplica, as_router

NOT_GZIP = b"this is not a gzip stream at all"


def port(running: RunningReplica) -> int:
    return int(urllib.parse.urlsplit(running.base_url).port or 0)


def signed(running: RunningReplica, path: str, tenant: str | None = "default") -> dict[str, str]:
    headers = {"X-Kvfleet-Tenant": tenant} if tenant else {}
    return as_router(headers, "POST", running.base_url + path)


def no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert record.levelno < logging.ERROR, record.getMessage()
        assert len(record.getMessage()) < 1000, record.getMessage()[:200]


def still_serving(running: RunningReplica) -> None:
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    answer = exchange(port(running), request(
        "POST", "/v1/completions", body,
        {**signed(running, "/v1/completions"), "Content-Type": "application/json"}))
    assert answer is not None and answer.status == 200, answer


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions",
                                  "/cache/invalidate"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_body_with_a_bad_content_encoding_is_a_400_in_the_envelope(
    running: RunningReplica, caplog: pytest.LogCaptureFixture, path: str, encoding: str
) -> None:
    # Fails before issue 25: 500 internal_error and an ERROR traceback.
    caplog.set_level(logging.DEBUG)
    tenant = None if path.startswith("/cache/") else "default"
    headers = {**signed(running, path, tenant), "Content-Type": "application/json",
               "Content-Encoding": encoding}
    answer = exchange(port(running), request("POST", path, NOT_GZIP, headers))
    assert answer is not None and answer.status == 400, answer
    assert answer.error["code"] == "invalid_body_encoding"
    assert encoding in answer.error["message"]
    no_traceback(caplog)
    still_serving(running)


def test_a_well_formed_gzip_body_is_still_accepted(running: RunningReplica) -> None:
    body = gzip.compress(json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode())
    headers = {**signed(running, "/v1/completions"), "Content-Type": "application/json",
               "Content-Encoding": "gzip"}
    answer = exchange(port(running), request("POST", "/v1/completions", body, headers))
    assert answer is not None and answer.status == 200, answer
