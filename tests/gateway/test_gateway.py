"""Through a real Envoy configured as a GIE gateway: `kvfleet epp` picks, real replicas serve."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.conftest import Gateway, start_gateway

PROMPT = "The gateway routes this document to the replica that computed it. " * 2 + "Go."


def post(gw: Gateway, path: str, body: Any, key: str | None = "sk-acme",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(gw.envoy.url + path, data=data, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(raw)
        except ValueError:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, raw.decode(
                errors="replace")


def test_completions_and_chat_through_envoy_with_the_openai_client(gateway: Gateway) -> None:
    c = gateway.client()
    done = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert done.choices[0].text and done.usage is not None and done.usage.prompt_tokens > 0
    chat = c.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                     messages=[{"role": "user", "content": "Hello"}])
    assert chat.choices[0].message.content is not None
    pieces = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                       temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == done.choices[0].text


def _cached(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", 0) or 0)


def _until_cached(c: openai.OpenAI, prompt: str, at_least: int) -> int:
    """Ask until the answer's usage says `at_least` tokens came from cache (the replicas admit
    a block on its second sighting and store it in the background); the cached count."""
    deadline = time.monotonic() + 20
    while True:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        if _cached(r.usage) >= at_least or time.monotonic() > deadline:
            return _cached(r.usage)
        time.sleep(0.05)


def test_the_requests_of_a_prefix_land_where_the_first_computed_it(gateway: Gateway) -> None:
    c = gateway.client()
    start = gateway.mark()
    prompts = [f"Document {d}: " + "every prefix has one home in the pool. " * 4
               for d in range(8)]
    first = [c.completions.create(model="tiny", prompt=p, max_tokens=2, temperature=0)
             for p in prompts]
    assert all(_cached(f.usage) == 0 for f in first)
    hits = [_until_cached(c, p + " More.", 16 * 8) for p in prompts]
    assert all(h >= 16 * 8 for h in hits), hits
    log = gateway.served(start, 16)
    assert all(e["upstream"] == e["destination"].split(",")[0] for e in log), log
    assert len({e["upstream"] for e in log[:8]}) == 2, log  # the documents over both homes


def test_two_tenants_never_see_each_others_blocks(gateway: Gateway) -> None:
    prompt = "A document both tenants send, word for word, to the same gateway. " * 3
    acme, globex = gateway.client("sk-acme"), gateway.client("sk-globex")
    assert _until_cached(acme, prompt, 16 * 8) >= 16 * 8
    theirs = globex.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert _cached(theirs.usage) == 0  # acme's KV is acme's: globex computes its own
    assert _until_cached(globex, prompt, 16 * 8) >= 16 * 8


def test_a_client_cannot_name_its_own_tenant_through_the_gateway(gateway: Gateway) -> None:
    status, _, body = post(gateway, "/v1/completions",
                           {"model": "tiny", "prompt": "hi", "max_tokens": 1},
                           headers={"X-Kvfleet-Tenant": "globex",
                                    "X-Kvfleet-Tenant-Assertion": "v1.1.2.3.r0"})
    assert status == 200, body  # served as acme (its key), the forged header replaced
    status, _, body = post(gateway, "/v1/completions",
                           {"model": "tiny", "prompt": "hi", "max_tokens": 1}, key=None,
                           headers={"X-Kvfleet-Tenant": "acme"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_body"),
    (b"{" + b'"prompt": "' + b"x" * 70000 + b'"}', 413, "body_too_large"),
    (json.dumps({"model": "tiny", "prompt": "x" * 400}).encode(), 400, None),  # the replica's
    (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": -1}).encode(), 400, None),
])
def test_bad_bodies_get_a_4xx_in_openais_envelope(gateway: Gateway, body: bytes, status: int,
                                                  code: str | None) -> None:
    got, headers, answer = post(gateway, "/v1/completions", body)
    assert got == status, answer
    assert headers.get("content-type", "").startswith("application/json")
    assert isinstance(answer, dict) and answer["error"]["message"], answer
    if code is not None:
        assert answer["error"]["code"] == code


def test_the_picks_decision_latency_and_usage_are_exported(gateway: Gateway) -> None:
    gateway.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                        temperature=0)
    text = gateway.epp.metrics()
    for series in ("kvfleet_epp_pick_seconds_count", "kvfleet_router_decision_seconds_count",
                   'kvfleet_epp_requests_total{outcome="picked"}',
                   'kvfleet_epp_usage_tokens_total{kind="prompt"}',
                   'kvfleet_epp_responses_total{status="200"}'):
        line = next((x for x in text.splitlines() if x.startswith(series)), None)
        assert line is not None and float(line.split()[-1]) > 0, series


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_the_picked_pod_dies_and_the_fallback_answers(tmp_path: Path, gateway_model: Path,
                                                       envoy: Path, mode: str) -> None:
    with contextlib.ExitStack() as stack:
        gw = start_gateway(stack, tmp_path, gateway_model, envoy, replicas=3,
                           request_body_mode=mode)
        c = gw.client()
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
        picked = gw.name_of(gw.served()[-1]["upstream"])
        gw.replicas[picked].__exit__(None, None, None)  # the pod dies; the EPP still lists it
        start = gw.mark()
        for stream in (False, True):
            out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                       temperature=0, stream=stream)
            if stream:
                assert [p for p in out]  # type: ignore[union-attr]
        log = gw.served(start, 2)
        assert [e["status"] for e in log] == [200, 200], log
        assert all(gw.name_of(e["upstream"]) != picked for e in log), log


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_failclose_when_the_epp_is_gone_is_a_503_in_openais_envelope(
        tmp_path: Path, gateway_model: Path, envoy: Path, mode: str) -> None:
    with contextlib.ExitStack() as stack:
        gw = start_gateway(stack, tmp_path, gateway_model, envoy, failure_mode="FailClose",
                           request_body_mode=mode)
        assert post(gw, "/v1/completions", {"model": "tiny", "prompt": "hi"})[0] == 200
        gw.epp.__exit__(None, None, None)
        status, headers, body = post(gw, "/v1/completions", {"model": "tiny", "prompt": "hi"})
        assert status == 503, body
        assert headers.get("content-type", "").startswith("application/json")
        assert body["error"]["type"] == "server_error" and body["error"]["message"], body


@pytest.mark.parametrize("secret", [None, b"test-router-secret"])
def test_failopen_when_the_epp_is_gone_a_ready_pod_answers(
        tmp_path: Path, gateway_model: Path, envoy: Path, secret: bytes | None) -> None:
    with contextlib.ExitStack() as stack:
        # BUFFERED: Envoy 1.40 fails open in FULL_DUPLEX_STREAMED only until a body chunk
        # went to the processor, so a FailOpen pool buffers (docs/gateway.md).
        gw = start_gateway(stack, tmp_path, gateway_model, envoy, failure_mode="FailOpen",
                           router_secret=secret, request_body_mode="BUFFERED")
        gw.epp.__exit__(None, None, None)
        status, _, body = post(gw, "/v1/completions",
                               {"model": "tiny", "prompt": "hi", "max_tokens": 1})
        if secret is None:
            assert status == 200, body  # one tenant (`default`): any pod serves it
        else:
            # No picker, no signed tenant: the pod refuses rather than guess one (never
            # another tenant's KV), in the envelope.
            assert 400 <= status < 500 and body["error"]["message"], body
        assert gw.served()[-1]["upstream"] not in ("", "-", None)
