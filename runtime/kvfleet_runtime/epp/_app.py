"""The EPP's process: the gRPC processor for the gateway, and an HTTP side for the cluster.

    gRPC  envoy.service.ext_proc.v3.ExternalProcessor   the gateway's questions (`_server`)
    GET   /metrics   Prometheus: the picker's decisions and latency, the EPP's requests, answers
                     and usage (`_state`), the KV event views
    GET   /healthz   the event loop answers
    GET   /readyz    keys loaded and at least one replica ready
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import aiohttp
import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_runtime.epp._server import grpc_server
from kvfleet_runtime.epp._state import EppState

__all__ = ["EppServer", "http_app", "run_epp"]

log = logging.getLogger(__name__)

_STATE = web.AppKey("epp_state", EppState)


def http_app(state: EppState) -> web.Application:
    app = web.Application()
    app[_STATE] = state
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    return app


async def _metrics(request: web.Request) -> web.StreamResponse:
    resp = web.Response(body=generate_latest(request.app[_STATE].registry))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


async def _healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    ready = sorted(x.name for x in state.view.loads() if x.ready)
    ok = bool(ready) and bool(state.tenancy.keys.digest_to_tenant)
    return web.json_response({
        "status": "ready" if ok else "not_ready",
        "ready_replicas": ready,
        "config_generation": state.view.config.generation if state.view.config else None,
        "config_error": state.view.config_error or None,
        "background_restarts": {n: k for n, k in state.picker.supervisor.restarts.items() if k},
    }, status=200 if ok else 503)


class EppServer:
    """Both sides and the picker's polls, started and stopped together."""

    def __init__(self, state: EppState, *, grpc_address: str, http_host: str, http_port: int
                 ) -> None:
        self.state = state
        self.grpc_address = grpc_address
        self.http_host = http_host
        self.http_port = http_port
        self.grpc_port = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        await self.state.picker.start(self._session, poll_interval_s=self.state.poll_interval_s,
                                      config_poll_s=self.state.config_poll_s)
        server, self.grpc_port = grpc_server(self.state, self.grpc_address)
        await server.start()
        self._grpc = server
        self._runner = web.AppRunner(http_app(self.state), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.http_host, self.http_port)
        await site.start()
        log.info("kvfleet epp: ext_proc on %s (port %d), HTTP on %s:%d", self.grpc_address,
                 self.grpc_port, self.http_host, self.http_port)

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.state.picker.stop()
        if self._session is not None:
            await self._session.close()


def run_epp(server: EppServer) -> None:
    """Serve until SIGTERM or SIGINT: streams in flight get the grace period to finish."""
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await server.start()
        try:
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(main())
