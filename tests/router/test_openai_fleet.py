"""The official `openai` client against a router and two real replicas on loopback: chat and
completions, streaming and not, stop, n, seed, cached tokens rising on a repeated prefix; the
router's own hardening (body limits before forwarding, slow bodies, bad JSON) and a client that
goes away; schemathesis against the router's /openapi.json."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
import torch
from aiohttp import web
from schemathesis import GenerationMode

from kvfleet_runtime.api import CANCEL_ON_DISCONNECT
from kvfleet_runtime.model import ModelArgs, generate_checkpoint
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.router import RouterState, create_router_app
from kvfleet_runtime.server import ReplicaAuth, build_replica
from kvfleet_runtime.server._config import ReplicaConfig
from tests.router.conftest import KEYS
from tests.runtime.server.conftest import (
    OPERATOR_TOKEN,
    ROUTER_SECRET,
    TEST_CONFIG,
    ServerThread,
)
from tests.runtime.server.test_fuzz import fuzz_operations

PREFIX = [(13 * i + 7) % 256 for i in range(48)]


class RouterThread:
    """The router app on 127.0.0.1 in its own thread and event loop (the openai client is sync)."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="router-under-test", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(create_router_app(self.state),
                                    handler_cancellation=CANCEL_ON_DISCONNECT)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> RouterThread:
        self._thread.start()
        assert self._started.wait(60), "router did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


@dataclass
class Fleet:
    url: str
    state: RouterState
    replicas: list[ServerThread]

    def client(self, key: str = "sk-acme") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def outcomes(self) -> dict[tuple[str, str], float]:
        return {(s.labels["replica"], s.labels["outcome"]): s.value
                for metric in self.state.m_requests.collect() for s in metric.samples
                if s.name.endswith("_total")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    torch.set_num_threads(1)
    model_dir = tmp_path_factory.mktemp("fleet-openai") / "tiny"
    generate_checkpoint(model_dir, ModelArgs.from_preset("tiny"), seed=0)
    config = ReplicaConfig.model_validate({**TEST_CONFIG, "model_dir": str(model_dir)})
    with contextlib.ExitStack() as stack:
        # As the chart runs them: replicas hold the router secret, the router signs tenants.
        servers = [stack.enter_context(ServerThread(build_replica(config), ReplicaAuth(
            router_secret=ROUTER_SECRET, operator_token=OPERATOR_TOKEN, name=f"r{i}")))
            for i in range(2)]
        view = FleetView(static_replicas={f"r{i}": f"http://127.0.0.1:{s.port}"
                                          for i, s in enumerate(servers)})
        state = RouterState(view=view, keys=KEYS, poll_interval_s=0.2, max_body_bytes=65536,
                            body_read_timeout_s=1.0, router_secret=ROUTER_SECRET)
        router = stack.enter_context(RouterThread(state))
        yield Fleet(f"http://127.0.0.1:{router.port}", state, servers)


def test_chat_through_the_router_stream_and_not(fleet: Fleet) -> None:
    c = fleet.client()
    messages: list[Any] = [{"role": "system", "content": "You are terse."},
                           {"role": "user", "content": "Hello"}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                      temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    stream = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == whole.choices[0].message.content
    last = stream[-1].usage
    assert last is not None and last.prompt_tokens == whole.usage.prompt_tokens
    assert last.prompt_tokens_details is not None


def test_completions_stop_n_seed_through_the_router(fleet: Fleet) -> None:
    c = fleet.client()
    plain = c.completions.create(model="tiny", prompt="The fleet", max_tokens=10, temperature=0)
    text = plain.choices[0].text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    cut = c.completions.create(model="tiny", prompt="The fleet", max_tokens=10, temperature=0,
                               stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model="tiny", prompt="The fleet", max_tokens=10,
                                         temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == cut.choices[0].text
    a = c.completions.create(model="tiny", prompt="Seeded", max_tokens=8, temperature=1.0,
                             n=2, seed=11)
    b = c.completions.create(model="tiny", prompt="Seeded", max_tokens=8, temperature=1.0,
                             n=2, seed=11)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.system_fingerprint is not None and a.system_fingerprint.startswith("fp_")


def test_cached_tokens_rise_on_a_repeated_prefix(fleet: Fleet) -> None:
    c = fleet.client("sk-globex")

    def cached(suffix: list[int]) -> int:
        r = c.completions.create(model="tiny", prompt=PREFIX + suffix, max_tokens=2,
                                 temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return int(r.usage.prompt_tokens_details.cached_tokens or 0)

    seen = [cached([1]), cached([2])]  # sighting 1 is not admitted; sighting 2 is stored
    assert seen[0] == 0
    deadline = time.monotonic() + 20
    while seen[-1] < 48:
        assert time.monotonic() < deadline, f"cached tokens never reached 48: {seen}"
        seen.append(cached([3 + len(seen)]))
    assert seen[-1] == 48  # the prefix's three full blocks
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                     max_tokens=1, temperature=0)
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None


def test_models_and_errors_through_the_router(fleet: Fleet) -> None:
    c = fleet.client()
    assert [m.id for m in c.models.list()] == ["tiny"]
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="not served here"):
        c.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError, match="not served here"):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError, match="missing or unknown API key"):
        fleet.client("sk-nobody").completions.create(model="tiny", prompt="x")
    with pytest.raises(openai.BadRequestError, match="tools: tool calling is not supported"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                  tools=[{"type": "function", "function": {"name": "f"}}])


def _raw(port: int, request: bytes) -> tuple[int, dict[str, Any]]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _port(fleet: Fleet) -> int:
    return int(fleet.url.rsplit(":", 1)[1])


def _requests_seen(fleet: Fleet) -> float:
    return sum(v for (_, outcome), v in fleet.outcomes().items())


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}", 400, "an integer of 5000 digits"),
        (b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, "nests deeper than 32"),
        (b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400, "prompt: a lone surrogate U+D800"),
        (b"[1]", 400, "must be a JSON object, got list"),
        (b'{"prompt": "' + b"z" * 70_000 + b'"}', 413, "exceeds the limit of 65536 bytes"),
    ],
)
def test_router_refuses_bad_bodies_before_forwarding(
    fleet: Fleet, body: bytes, status: int, needle: str
) -> None:
    before = _requests_seen(fleet)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-acme\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    got, answer = _raw(_port(fleet), head + body)
    assert got == status and needle in answer["error"]["message"]
    assert _requests_seen(fleet) == before  # nothing reached a replica


def test_router_slow_body_is_a_408(fleet: Fleet) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-acme\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    status, answer = _raw(_port(fleet), head + b'{"message')
    assert status == 408
    assert answer["error"]["message"] == ("request body did not arrive within 1 s (9 bytes "
                                          "received of 100 announced)")


def test_router_unknown_route_and_method_are_json(fleet: Fleet) -> None:
    status, answer = _raw(_port(fleet), b"GET /v2/x HTTP/1.1\r\nHost: x\r\nConnection: close"
                                        b"\r\n\r\n")
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    status, answer = _raw(_port(fleet), b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                        b"Connection: close\r\n\r\n")
    assert status == 405 and answer["error"]["code"] == "method_not_allowed"


async def _abandon(url: str) -> None:
    body = {"prompt": PREFIX, "max_tokens": 32, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(
        url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-acme"}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()  # the first event arrived; then the client leaves


def _wait_for(predicate: Any, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_client_that_goes_away_is_client_abort_not_a_broken_replica(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    engines = [s.replica.engine for s in fleet.replicas]

    def aborts() -> float:
        return sum(e.metrics.requests.labels("abort")._value.get() for e in engines)

    before = aborts()
    with caplog.at_level(logging.DEBUG):
        asyncio.run(_abandon(fleet.url))
        _wait_for(lambda: any(o == "client_abort" for _, o in fleet.outcomes()))
        _wait_for(lambda: aborts() == before + 1)  # the replica cancelled the sequence
        _wait_for(lambda: all(e.num_running == 0 for e in engines))
        time.sleep(0.2)
    outcomes = {o for _, o in fleet.outcomes()}
    assert "client_abort" in outcomes and "broken" not in outcomes
    assert all(e.kv.num_free_blocks == e.kv.num_blocks for e in engines)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_fuzz_router_from_its_openapi_finds_no_failure_of_any_check(
    fleet: Fleet, mode: GenerationMode
) -> None:
    paths, nothing_invalid = fuzz_operations(
        fleet.url, mode, headers={"Authorization": "Bearer sk-acme"}, max_examples=10)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
            "/healthz", "/readyz", "/metrics"} == paths
    assert nothing_invalid <= {"/v1/models/{model}"}


def test_router_openapi_has_the_router_auth_not_the_tenant_header(fleet: Fleet) -> None:
    doc = json.loads(_get(fleet.url + "/openapi.json"))
    op = doc["paths"]["/v1/chat/completions"]["post"]
    assert op["security"] == [{"apiKey": []}] and "401" in op["responses"]
    assert all(p["name"] != "X-Kvfleet-Tenant" for p in op["parameters"])
    assert doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert "/cache/invalidate" not in doc["paths"]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


def test_a_non_streaming_client_that_goes_away_cancels_the_replica_request(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    # Hold every replica request in the fleet hook (before the engine sees it), so the client
    # leaves while the router waits for the replica's answer: no timing involved.
    entered, cancelled = threading.Event(), threading.Event()

    async def hold(tenant: str, token_ids: list[int]) -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def leave() -> None:
        async with aiohttp.ClientSession() as session:
            post = session.post(fleet.url + "/v1/completions",
                                json={"prompt": "held", "max_tokens": 4},
                                headers={"Authorization": "Bearer sk-acme"})
            task = asyncio.ensure_future(post)
            while not entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()  # the client gives up and closes its connection
            with contextlib.suppress(asyncio.CancelledError):
                await task

    replicas = [s.replica for s in fleet.replicas]
    submitted = [r.engine.metrics.prompt_tokens._value.get() for r in replicas]
    before = sum(v for (_, o), v in fleet.outcomes().items() if o == "client_abort")
    for r in replicas:
        r.before_submit = hold
    try:
        with caplog.at_level(logging.DEBUG):
            asyncio.run(leave())
            _wait_for(cancelled.is_set)  # the router closed its request; the replica cancelled
            _wait_for(lambda: sum(v for (_, o), v in fleet.outcomes().items()
                                  if o == "client_abort") == before + 1)
    finally:
        for r in replicas:
            r.before_submit = None
    assert [r.engine.metrics.prompt_tokens._value.get() for r in replicas] == submitted
    assert "broken" not in {o for _, o in fleet.outcomes()}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_router_refuses_a_chunked_body_over_the_limit_without_forwarding(fleet: Fleet) -> None:
    def body() -> Iterator[bytes]:  # no Content-Length: the router counts as it reads
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"z" * 65536  # 4 MiB in all; the router's limit here is 64 KiB
        yield b'"}'

    before = _requests_seen(fleet)
    req = urllib.request.Request(fleet.url + "/v1/completions", data=body(), method="POST",
                                 headers={"Authorization": "Bearer sk-acme",
                                          "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 413
    error = json.loads(err.value.read())["error"]
    assert error["message"] == "request body exceeds the limit of 65536 bytes"
    assert _requests_seen(fleet) == before
