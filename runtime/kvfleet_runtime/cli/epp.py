"""`kvfleet epp`: the picker as the endpoint picker of a Gateway API Inference Extension gateway."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from kvfleet_runtime.cli import _front as front
from kvfleet_runtime.cli._app import app, fail

__all__ = ["epp"]


@app.command()
def epp(
    keys: front.Keys,
    grpc_host: Annotated[str, typer.Option(help="Address the gateway's ext_proc reaches.")
                         ] = "127.0.0.1",
    grpc_port: Annotated[int, typer.Option(help="ext_proc port (GIE's default: 9002).")] = 9002,
    http_host: Annotated[str, typer.Option(help="Address of /metrics, /healthz, /readyz.")
                         ] = "127.0.0.1",
    http_port: Annotated[int, typer.Option(help="Port of /metrics, /healthz, /readyz.")] = 9090,
    fleet_config: front.FleetConfig = None,
    replica: front.Replicas = None,
    redis_url: front.RedisUrl = None,
    redis_cluster_urls: front.RedisClusterUrls = None,
    hint_lookup_budget_s: front.HintLookupBudget = front.DEFAULT_HINT_LOOKUP_BUDGET_S,
    redis_max_connections: front.RedisMaxConnections = front.DEFAULT_REDIS_MAX_CONNECTIONS,
    k: front.HomesK = front.DEFAULT_HOMES_K,
    occupancy_threshold: front.OccupancyThreshold = front.DEFAULT_OCCUPANCY_THRESHOLD,
    recompute_s_per_token: front.RecomputeCost = None,
    poll_interval_s: front.PollInterval = 0.5,
    tokenizer: front.TokenizerDir = None,
    max_fallbacks: Annotated[
        int, typer.Option(help="Fallback endpoints after the pick (Envoy retries on them in "
                          "order).")
    ] = 2,
    max_body_bytes: Annotated[
        int, typer.Option(help="A larger request body is refused with 413.")] = 1 << 20,
    kv_events: front.KvEvents = None,
    kv_events_port: front.KvEventsPort = None,
    log_level: front.LogLevel = "INFO",
) -> None:
    """Answer a GIE gateway's Envoy (ext_proc) with the replica for each request.

    The same picker as `kvfleet router`: the API key's tenant, its homes, the prefix's owner,
    the hint index and vLLM's KV events. The destination and its fallbacks go back as the
    protocol's x-gateway-destination-endpoint (docs/gateway.md)."""
    for name, value in (("--grpc-port", grpc_port), ("--http-port", http_port)):
        if not 0 <= value < 65536:
            fail(f"{name} must be in [0, 65535], got {value}")
    if not 0 <= max_fallbacks <= 7:
        fail(f"--max-fallbacks must be in [0, 7], got {max_fallbacks}")
    if max_body_bytes < 1:
        fail(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
    try:
        from kvfleet_runtime.epp import EppServer, EppState, run_epp
    except ImportError as exc:
        fail(f"kvfleet epp needs the gateway extra (pip install 'kvfleet[gateway]'): {exc}")
    inputs = front.picker_inputs(
        keys=keys, fleet_config=fleet_config, replica=replica, redis_url=redis_url,
        redis_cluster_urls=redis_cluster_urls, hint_lookup_budget_s=hint_lookup_budget_s,
        redis_max_connections=redis_max_connections, k=k,
        occupancy_threshold=occupancy_threshold, recompute_s_per_token=recompute_s_per_token,
        poll_interval_s=poll_interval_s, tokenizer=tokenizer, kv_events=kv_events,
        kv_events_port=kv_events_port)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    state = EppState(
        view=inputs.view, keys=inputs.keys, index=inputs.index, tokenizer=inputs.tokenizer,
        router_secret=inputs.router_secret, kv_events=inputs.kv_events,
        kv_event_endpoints=inputs.kv_event_endpoints, kv_events_port=inputs.kv_events_port,
        max_fallbacks=max_fallbacks, max_body_bytes=max_body_bytes,
        poll_interval_s=poll_interval_s)
    host = f"[{grpc_host}]" if ":" in grpc_host else grpc_host
    run_epp(EppServer(state, grpc_address=f"{host}:{grpc_port}", http_host=http_host,
                      http_port=http_port))
