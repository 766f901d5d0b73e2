"""`kvfleet epp`: the picker as a Gateway API Inference Extension endpoint picker.

The user's gateway (Envoy Gateway, kgateway, Istio: any Envoy with the ext_proc filter and the
`override_host` load balancing policy, as an InferencePool's `endpointPickerRef` configures it)
asks this process which replica serves each request; the answer is the same picker's as
`kvfleet router`'s (`kvfleet_runtime.picker`), so the tenant, the prefix's home, the hint index
and vLLM's KV events decide here too.

    _protocol   the GIE endpoint-picker protocol as ext_proc messages (pure)
    _exchange   one request's stream: headers, body, the pick, the answer observed
    _state      settings, the picker and tenancy it composes, the EPP's metrics
    _server     the grpc.aio shell
    _app        the process: gRPC and the HTTP probes and metrics, started and stopped together

Needs the `gateway` extra (grpcio, xds-protos); `kvfleet router` does not import this package.
"""

from __future__ import annotations

from kvfleet_runtime.epp._app import EppServer, http_app, run_epp
from kvfleet_runtime.epp._exchange import COMPLETION_PATHS, Exchange, usage_of
from kvfleet_runtime.epp._protocol import DESTINATION_HEADER, DESTINATION_NAMESPACE
from kvfleet_runtime.epp._state import EppState

__all__ = ["COMPLETION_PATHS", "DESTINATION_HEADER", "DESTINATION_NAMESPACE", "EppServer",
           "EppState", "Exchange", "http_app", "run_epp", "usage_of"]
