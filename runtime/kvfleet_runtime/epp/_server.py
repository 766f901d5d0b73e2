"""The gRPC shell: Envoy's `ExternalProcessor.Process`, one `Exchange` per stream (grpc.aio)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from kvfleet_runtime.epp._exchange import Exchange
from kvfleet_runtime.epp._state import EppState

__all__ = ["ExternalProcessor", "grpc_server"]

log = logging.getLogger(__name__)


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, state: EppState) -> None:
        self.state = state

    async def Process(
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext[ext_proc.ProcessingRequest,
                                          ext_proc.ProcessingResponse],
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = Exchange(self.state)
        self.state.m_streams.inc()
        try:
            async for message in request_iterator:
                try:
                    answers = await exchange.on(message)
                except Exception:
                    # The gateway's failure mode decides (FailOpen: on without a pick;
                    # FailClose: its error answer); never a half-made routing answer.
                    log.exception("EPP: processing a %s failed", message.WhichOneof("request"))
                    await context.abort(grpc.StatusCode.INTERNAL, "the picker failed")
                    return
                for answer in answers:
                    yield answer
        finally:
            exchange.close()
            self.state.m_streams.dec()


def grpc_server(state: EppState, address: str) -> tuple[grpc.aio.Server, int]:
    """A server with the processor on `address` (`host:port`, port 0: any); its bound port."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(state), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port
