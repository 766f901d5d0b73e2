"""The endpoint-picker protocol's messages and an exchange's answers, without Envoy (pure, and the
picker over fake replicas on loopback)."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from kvfleet_runtime.epp import usage_of
from kvfleet_runtime.epp._protocol import (
    DESTINATION_HEADER,
    Destination,
    body_modes,
    destination_addresses,
    headers_of,
    immediate_error,
    routed,
)


def _headers(**pairs: str) -> ext_proc.HttpHeaders:
    h = ext_proc.HttpHeaders()
    for k, v in pairs.items():
        h.headers.headers.append(base_pb2.HeaderValue(key=k.replace("_", "-"),
                                                      raw_value=v.encode()))
    return h


def test_headers_are_read_from_raw_values_lower_cased_and_repeats_joined() -> None:
    h = _headers(Authorization="Bearer k")
    h.headers.headers.append(base_pb2.HeaderValue(key="X-A", value="1"))
    h.headers.headers.append(base_pb2.HeaderValue(key="x-a", raw_value=b"2"))
    assert headers_of(h) == {"authorization": "Bearer k", "x-a": "1,2"}


def test_the_body_modes_come_from_the_first_messages_protocol_config() -> None:
    first = ext_proc.ProcessingRequest(request_headers=_headers())
    assert body_modes(first) is None
    first.protocol_config.request_body_mode = 4  # FULL_DUPLEX_STREAMED
    first.protocol_config.response_body_mode = 1  # STREAMED
    assert body_modes(first) == ("full_duplex", "streamed")
    first.protocol_config.request_body_mode = 2
    assert body_modes(first) == ("buffered", "streamed")


def test_the_destination_is_the_pick_then_its_fallbacks_in_metadata_and_header() -> None:
    d = Destination(destination_addresses("10.0.0.5:8000", ["10.0.0.6:8000", "[::1]:80"]),
                    {"X-Kvfleet-Tenant": "acme"}, remove=["authorization"], body=b'{"a":1}')
    answer = routed(d, phase="body")
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta[DESTINATION_HEADER].string_value == "10.0.0.5:8000,10.0.0.6:8000,[::1]:80"
    common = answer.request_body.response
    set_ = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert set_ == {DESTINATION_HEADER: b"10.0.0.5:8000", "x-kvfleet-tenant": b"acme",
                    "content-length": b"7"}
    assert list(common.header_mutation.remove_headers) == ["authorization"]
    assert common.body_mutation.body == b'{"a":1}'
    # to the headers (full duplex): the body goes back as a streamed chunk instead
    assert not routed(d, phase="headers").request_headers.response.HasField("body_mutation")


def test_a_refusal_is_an_immediate_answer_in_openais_envelope() -> None:
    answer = immediate_error(401, "missing key", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"}).immediate_response
    assert answer.status.code == 401 and answer.details == "kvfleet_epp_invalid_api_key"
    assert json.loads(answer.body) == {"error": {
        "message": "missing key", "type": "authentication_error", "param": None,
        "code": "invalid_api_key"}}
    assert {h.header.key for h in answer.headers.set_headers} == {"content-type",
                                                                  "www-authenticate"}


def test_usage_is_read_from_a_json_answer_or_a_streams_last_usage_event() -> None:
    whole = json.dumps({"usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 8}}}).encode()
    assert usage_of(whole) == {"prompt": 10, "completion": 2, "cached": 8}
    stream = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
              b"data: [DONE]\n\n")
    assert usage_of(stream) == {"prompt": 5, "completion": 1}
    assert usage_of(b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n') is None
    assert usage_of(b'{"usage": "nonsense"}') is None
    assert usage_of(b"\xff\xfe") is None
