"""The replica's HTTP layer under hostile input, at the socket level (raw bytes on loopback,
issue 25): every refusal is a 4xx in OpenAI's envelope, logged as at most one short line, and the
replica answers the next request."""

from __future__ import annotations

import gzip
import json
import logging
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.rawhttp import exchange, malformed, request

from .conftest import METRICS_TOKEN, OPERATOR_TOKEN, TEST_CONFIG, RunningReplica, as_router

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


# ---- config input (items 5 and 6) ------------------------------------------------------------

DEEP = "limits:\n  max_tokens: " + "[" * 5000 + "]" * 5000 + "\n"
"""Deep enough that PyYAML's recursive composer raised RecursionError (which killed the watcher
before issue 25)."""
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
"""Nested anchors: ~600 bytes that expand to 10**9 strings."""


def _wait(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _readyz(running: RunningReplica) -> dict[str, Any]:
    answer = exchange(port(running), request("GET", "/readyz"))
    assert answer is not None and answer.status == 200, answer
    return dict(answer.json())


@pytest.mark.parametrize(("text", "why"), [
    (DEEP, "nests deeper than 32 levels"), (LAUGHS, "aliases"),
    # issue 44: PyYAML's ReaderError escaped the parser and killed the watcher (8a5e244)
    ("limits: {max_tokens: 64}\nx: \x07\n", "unacceptable character #x0007"),
    (b"limits: {max_tokens: 64}\nx: \xc3\x28\n", "invalid continuation byte"),
    (b'{"limits": {"max_tokens": 64}, "x": "\xff"}', "invalid start byte")])
def test_a_hostile_config_file_is_refused_in_one_line_and_the_next_valid_one_applies(
    running: RunningReplica, caplog: pytest.LogCaptureFixture, text: str | bytes, why: str
) -> None:
    # Fails before issue 25: the deep file kills the watcher silently (the next valid file is
    # never applied, /readyz says nothing); the laughs stall the loop and log ~2 GB.
    caplog.set_level(logging.DEBUG)
    replica = running.replica
    try:
        running.config_path.write_bytes(text if isinstance(text, bytes) else text.encode())
        _wait(lambda: "replica" in _readyz(running)["config_errors"], "the refusal")
        reason = _readyz(running)["config_errors"]["replica"]
        assert why in reason and str(running.config_path) in reason and "\n" not in reason
        refusals = [r for r in caplog.records
                    if "config reload rejected" in r.getMessage() and r.levelno >= logging.INFO]
        assert len(refusals) == 1 and len(refusals[0].getMessage()) < 1000
        still_serving(running)
        changed = json.loads(json.dumps(TEST_CONFIG))
        changed["limits"]["max_tokens"] = 5
        running.config_path.write_text(yaml.safe_dump(changed))
        _wait(lambda: replica.config.limits.max_tokens == 5, "the next valid file")
        assert _readyz(running)["config_errors"] == {}
    finally:
        running.config_path.write_text(yaml.safe_dump(TEST_CONFIG))
        _wait(lambda: replica.config.limits.max_tokens == 32, "the test config")


def test_a_config_field_error_names_the_field_in_one_short_line(
    running: RunningReplica
) -> None:
    replica = running.replica
    try:
        running.config_path.write_text("limits:\n  max_tokens: &x " + "y" * 100_000 + "\n")
        _wait(lambda: "replica" in _readyz(running)["config_errors"], "the refusal")
        reason = _readyz(running)["config_errors"]["replica"]
        assert "limits.max_tokens" in reason and len(reason) <= 500
    finally:
        running.config_path.write_text(yaml.safe_dump(TEST_CONFIG))
        _wait(lambda: replica.config.limits.max_tokens == 32 and
              not replica.config_errors, "the test config")


# ---- aiohttp's parser refusals (item 8) ------------------------------------------------------

@pytest.mark.parametrize("name", sorted(malformed("/v1/completions")))
def test_requests_the_http_parser_refuses_are_4xx_in_the_envelope_and_one_log_line(
    running: RunningReplica, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    # Fails before issue 25: plain-text 400s and an ERROR traceback for each.
    caplog.set_level(logging.DEBUG)
    answer = exchange(port(running), malformed("/v1/completions")[name])
    assert answer is not None and 400 <= answer.status < 500, answer
    assert answer.error["code"] == "malformed_request"
    no_traceback(caplog)
    own = [r.getMessage() for r in caplog.records if r.name != "aiohttp.access"]
    assert len(own) <= 1 and all("\n" not in m and len(m) < 400 for m in own), own
    still_serving(running)


def test_header_limits_are_nginx_and_envoy_values(running: RunningReplica) -> None:
    ok = exchange(port(running), request("GET", "/healthz", headers={
        **{f"X-H{i}": "v" for i in range(90)}, "X-Big": "a" * 8000}))
    assert ok is not None and ok.status == 200
    for headers in ({f"X-H{i}": "v" for i in range(101)}, {"X-Big": "a" * 8200}):
        refused = exchange(port(running), request("GET", "/healthz", headers=headers))
        assert refused is not None and refused.status in (400, 431), refused
        assert refused.error["code"] == "malformed_request"


# ---- /metrics (item 1) -----------------------------------------------------------------------

def test_metrics_show_tenant_names_and_figures_only_to_the_scrape_token(
    running: RunningReplica
) -> None:
    # Fails before issue 25: every tenant's name and hit figures for anyone.
    still_serving(running)  # tenant "default" has figures now
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1}).encode()
    answer = exchange(port(running), request("POST", "/v1/completions", body, {
        **signed(running, "/v1/completions", "secret-tenant"), "Content-Type": "application/json"}))
    assert answer is not None and answer.status == 200

    def scrape(headers: dict[str, str]) -> str:
        got = exchange(port(running), request("GET", "/metrics", headers=headers))
        assert got is not None and got.status == 200
        return got.body.decode()

    for headers in ({}, {"Authorization": "Bearer " + OPERATOR_TOKEN.decode()},
                    {"Authorization": "Bearer wrong"}):
        text = scrape(headers)
        assert "secret-tenant" not in text and 'tenant="' not in text
        assert "kvfleet_cache_tier_used_blocks" in text  # fleet-wide series stay public
    full = scrape({"Authorization": "Bearer " + METRICS_TOKEN.decode()})
    assert 'kvfleet_cache_lookup_tokens_total{tenant="secret-tenant"}' in full
