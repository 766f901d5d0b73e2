"""The Gateway API Inference Extension's endpoint-picker protocol over Envoy's ext_proc (pure).

The gateway's Envoy streams each HTTP request's headers and body to the picker over one gRPC
stream (`envoy.service.ext_proc.v3.ExternalProcessor.Process`); the picker answers with

    the destination   dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`:
                      `IP:port[,IP:port...]`, the pick then its fallbacks (Envoy's
                      `override_host` load balancing policy takes the first, and the next on
                      each retry), and the same in the request header of that name
    header changes    the tenant and its signed assertions set, the API key removed
    a body change     vLLM's `cache_salt` (`picker.Tenancy.vllm_body`)
    or a refusal      an immediate response: OpenAI's error envelope, never forwarded

How the body arrives is Envoy's choice (`processing_mode.request_body_mode`, told in each
stream's first message): BUFFERED (one message after a header answer), FULL_DUPLEX_STREAMED
(chunks, answered once whole with the headers and the body as one streamed chunk), or none
(the pick has no prompt: tenant affinity only).

Everything here builds or reads messages; the stream's state machine is `_exchange`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Literal

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvfleet_runtime.api import error_body

__all__ = [
    "DESTINATION_HEADER",
    "DESTINATION_NAMESPACE",
    "BodyMode",
    "Destination",
    "body_modes",
    "continue_body",
    "continue_headers",
    "destination_addresses",
    "echo_body",
    "headers_of",
    "immediate_error",
    "routed",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""The GIE protocol's name for the picked endpoint, as a header and as the metadata key."""
DESTINATION_NAMESPACE = "envoy.lb"
"""The metadata namespace Envoy's `override_host` policy reads the destination from."""

BodyMode = Literal["none", "buffered", "streamed", "full_duplex"]

_MODES: dict[int, BodyMode] = {
    0: "none",  # NONE
    1: "streamed",  # STREAMED
    2: "buffered",  # BUFFERED
    3: "buffered",  # BUFFERED_PARTIAL: one message too, cut at Envoy's buffer limit
    4: "full_duplex",  # FULL_DUPLEX_STREAMED
}
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def body_modes(request: ext_proc.ProcessingRequest) -> tuple[BodyMode, BodyMode] | None:
    """The request and response body modes Envoy says it uses (its first message's
    `protocol_config`); None when this message does not say."""
    if not request.HasField("protocol_config"):
        return None
    config = request.protocol_config
    return (_MODES.get(config.request_body_mode, "none"),
            _MODES.get(config.response_body_mode, "none"))


def headers_of(headers: ext_proc.HttpHeaders) -> dict[str, str]:
    """Lower-cased name -> value (`raw_value`, which Envoy sends, else `value`); a repeated
    header's values joined by commas, as HTTP allows."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def destination_addresses(primary: str, fallbacks: Sequence[str]) -> str:
    """The protocol's value: the pick, then the fallbacks, comma-separated."""
    return ",".join((primary, *fallbacks))


class Destination:
    """What a pick changes on the request: where it goes, headers set and removed, the body."""

    __slots__ = ("addresses", "body", "remove", "set_headers")

    def __init__(self, addresses: str, set_headers: Mapping[str, str],
                 remove: Sequence[str] = (), body: bytes | None = None) -> None:
        self.addresses = addresses
        self.set_headers = {DESTINATION_HEADER: addresses.split(",", 1)[0], **set_headers}
        if body is not None:
            self.set_headers["content-length"] = str(len(body))
        self.remove = tuple(remove)
        self.body = body
        """The body to send instead (None: as it came)."""

    def header_mutation(self) -> ext_proc.HeaderMutation:
        return ext_proc.HeaderMutation(
            set_headers=[base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()),
                append_action=_OVERWRITE) for k, v in self.set_headers.items()],
            remove_headers=[r.lower() for r in self.remove])

    def metadata(self) -> struct_pb2.Struct:
        out = struct_pb2.Struct()
        out.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: self.addresses}})
        return out


def routed(destination: Destination, *, phase: Literal["headers", "body"],
           body: bytes | None = None) -> ext_proc.ProcessingResponse:
    """The answer that sends the request on: to the request headers (FULL_DUPLEX_STREAMED and no
    body: `body` None) or to the buffered body (BUFFERED: the body mutation, if any, with it)."""
    common = ext_proc.CommonResponse(header_mutation=destination.header_mutation())
    if phase == "body" and destination.body is not None:
        common.body_mutation.body = destination.body
    response = ext_proc.ProcessingResponse(dynamic_metadata=destination.metadata())
    if phase == "headers":
        response.request_headers.response.CopyFrom(common)
    else:
        response.request_body.response.CopyFrom(common)
    return response


def continue_headers(*, response: bool = False) -> ext_proc.ProcessingResponse:
    """Headers go on unchanged (the request's, or with `response` the answer's)."""
    out = ext_proc.ProcessingResponse()
    (out.response_headers if response else out.request_headers).response.SetInParent()
    return out


def continue_body(*, response: bool = False) -> ext_proc.ProcessingResponse:
    """A body chunk goes on unchanged (STREAMED and BUFFERED modes)."""
    out = ext_proc.ProcessingResponse()
    (out.response_body if response else out.request_body).response.SetInParent()
    return out


def echo_body(chunk: bytes, end_of_stream: bool, *, response: bool = False
              ) -> ext_proc.ProcessingResponse:
    """A body chunk sent back as it is to go on (FULL_DUPLEX_STREAMED: Envoy forwards only what
    the processor returns)."""
    out = ext_proc.ProcessingResponse()
    body = out.response_body if response else out.request_body
    body.response.body_mutation.streamed_response.body = chunk
    body.response.body_mutation.streamed_response.end_of_stream = end_of_stream
    return out


def immediate_error(status: int, message: str, *, code: str | None = None,
                    param: str | None = None, headers: Mapping[str, str] | None = None
                    ) -> ext_proc.ProcessingResponse:
    """The request is answered here, in OpenAI's error envelope, and never forwarded."""
    body = json.dumps(error_body(status, message, param=param, code=code)).encode()
    mutation = ext_proc.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()),
                                   append_action=_OVERWRITE)
        for k, v in {"content-type": "application/json", **(headers or {})}.items()])
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=body,
        details=f"kvfleet_epp_{code or status}"))
