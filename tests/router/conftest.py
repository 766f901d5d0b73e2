"""Fake replicas (real aiohttp servers on 127.0.0.1) and a router in front of them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvfleet_runtime.affinity import parse_api_keys
from kvfleet_runtime.api import AppRunner
from kvfleet_runtime.fleet import EmbeddedHintIndex
from kvfleet_runtime.picker import FleetView
from kvfleet_runtime.router import RouterState, create_router_app
from kvfleet_runtime.wire import LOAD_PATH
from tests.support import free_port

KEYS = parse_api_keys({"tenants": {"acme": ["sk-acme"], "globex": ["sk-globex"]}})
KEY_FIELDS = {
    "model_id": "tiny",
    "weights_digest": "sha256:" + "cd" * 32,
    "kv_dtype": "float32",
    "rope_config_hash": "rope0",
    "attn_impl_id": "sdpa",
}




CUT_EVENT = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"!"}]}\n\n'
"""The event a "cut_mid_event" replica is cut inside of (issue 44 item 5)."""


@dataclass
class FakeReplica:
    name: str
    load: dict[str, Any] = field(
        default_factory=lambda: {
            "ready": True,
            "kv_occupancy": 0.1,
            "queue_delay_s": 0.0,
            "cache_key": KEY_FIELDS,
            "tokenizer": "byte-v1",
        }
    )
    seen: list[dict[str, Any]] = field(default_factory=list)
    delay_s: float = 0.0
    status: int = 200
    fault: str = ""
    """Injected failure: "stall" (never answers), "sse_stall" (SSE headers and the role chunk,
    then nothing), "html_500" (a proxy's HTML error page), "cut_before_token" (the role chunk,
    then the connection closes), "cut_after_token" (two tokens, then the connection closes),
    "cut_mid_event" (two tokens, then the first `cut_at` bytes of `CUT_EVENT`, then the
    connection closes)."""
    cut_at: int = 0
    before_answer: Callable[[FakeReplica], Awaitable[None]] | None = None
    """Awaited when a completion arrives, before it is answered (a fleet change mid-request)."""
    url: str = ""
    runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.seen.append({"headers": dict(request.headers), "body": body})
            if self.before_answer is not None:
                await self.before_answer(self)
            if self.status != 200:
                return web.json_response({"error": {"message": "busy"}}, status=self.status)
            if self.fault:
                return await self._faulty(request)
            await asyncio.sleep(self.delay_s)
            tenant = request.headers.get("X-Kvfleet-Tenant")
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i in range(5):
                    await resp.write(f"data: {json.dumps({'i': i, 'tenant': tenant})}\n\n".encode())
                    await asyncio.sleep(0.01)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            return web.json_response(
                {"replica": self.name, "tenant": tenant}, headers={"X-Kvfleet-Cached-Tokens": "0"}
            )

        async def chat(request: web.Request) -> web.StreamResponse:
            return await completions(request)

        async def load(request: web.Request) -> web.StreamResponse:
            return web.json_response(self.load)

        async def models(request: web.Request) -> web.StreamResponse:
            return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get(LOAD_PATH, load)
        app.router.add_get("/v1/models", models)
        return app

    async def _faulty(self, request: web.Request) -> web.StreamResponse:
        if self.fault == "stall":
            await asyncio.sleep(3600)
        if self.fault == "html_500":
            return web.Response(status=500, text="<html><body>500 oops</body></html>",
                                content_type="text/html")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        await resp.write(f"data: {json.dumps(role)}\n\n".encode())
        if self.fault == "sse_stall":
            await asyncio.sleep(3600)
        if self.fault in ("cut_after_token", "cut_mid_event"):
            for text in ("he", "llo"):
                token = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(token)}\n\n".encode())
        if self.fault == "cut_mid_event":
            await resp.write(CUT_EVENT[: self.cut_at])
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # the replica dies mid-answer
        return resp

    async def start(self, port: int | None = None) -> None:
        # As replicas run: a request the router closes cancels its handler (a stalled one too).
        self.runner = web.AppRunner(self.app(), handler_cancellation=True)
        await self.runner.setup()
        port = port or free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@dataclass
class RouterHandle:
    url: str
    state: RouterState
    session: aiohttp.ClientSession

    async def post(
        self,
        body: dict[str, Any],
        key: str | None = "sk-acme",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        h = dict(headers or {})
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        async with self.session.post(self.url + "/v1/completions", json=body, headers=h) as r:
            text = await r.text()
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                data = text
            return r.status, dict(r.headers), data

    async def refresh(self) -> None:
        await self.state.view.poll_once(self.session, timeout_s=1.0)


StartRouter = Callable[..., Awaitable[RouterHandle]]


@pytest.fixture
async def replicas() -> AsyncIterator[list[FakeReplica]]:
    reps = [FakeReplica(f"r{i}") for i in range(5)]
    for r in reps:
        await r.start()
    yield reps
    for r in reps:
        await r.stop()


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    runners: list[web.AppRunner] = []
    session = aiohttp.ClientSession()

    async def start(reps: list[FakeReplica], **view_kwargs: Any) -> RouterHandle:
        index = view_kwargs.pop("index", None)
        state_kwargs = view_kwargs.pop("state", {})  # RouterState settings (timeouts)
        view = FleetView(static_replicas={r.name: r.url for r in reps}, **view_kwargs)
        state = RouterState(
            view=view, keys=KEYS, index=index, poll_interval_s=3600, config_poll_s=0.05,
            **state_kwargs,
        )
        runner = AppRunner(create_router_app(state))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return RouterHandle(f"http://127.0.0.1:{port}", state, session)

    yield start
    for runner in runners:
        await runner.cleanup()
    await session.close()


__all__ = ["CUT_EVENT", "KEY_FIELDS", "EmbeddedHintIndex", "FakeReplica", "RouterHandle",
           "StartRouter"]
