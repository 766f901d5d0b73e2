"""`kvfleet router`: the fleet's OpenAI-compatible front door."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from kvfleet_runtime.cli import _front as front
from kvfleet_runtime.cli._app import app, fail
from kvfleet_runtime.cli._front import redis_url_from
from kvfleet_runtime.pools import UPSTREAM_MAX_CONNECTIONS, UPSTREAM_MAX_CONNECTIONS_PER_REPLICA

__all__ = ["redis_url_from", "router"]


@app.command()
def router(
    keys: front.Keys,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    fleet_config: front.FleetConfig = None,
    replica: front.Replicas = None,
    redis_url: front.RedisUrl = None,
    redis_cluster_urls: front.RedisClusterUrls = None,
    hint_lookup_budget_s: front.HintLookupBudget = front.DEFAULT_HINT_LOOKUP_BUDGET_S,
    redis_max_connections: front.RedisMaxConnections = front.DEFAULT_REDIS_MAX_CONNECTIONS,
    upstream_max_connections_per_replica: Annotated[
        int, typer.Option(help="Connections to one replica; requests beyond wait for one.")
    ] = UPSTREAM_MAX_CONNECTIONS_PER_REPLICA,
    upstream_max_connections: Annotated[
        int, typer.Option(help="Connections to all replicas together.")
    ] = UPSTREAM_MAX_CONNECTIONS,
    k: front.HomesK = front.DEFAULT_HOMES_K,
    occupancy_threshold: front.OccupancyThreshold = front.DEFAULT_OCCUPANCY_THRESHOLD,
    recompute_s_per_token: front.RecomputeCost = None,
    poll_interval_s: front.PollInterval = 0.5,
    tokenizer: front.TokenizerDir = None,
    header_read_timeout_s: Annotated[
        float, typer.Option(help="A request head must arrive within this (also the idle "
                            "keep-alive time).")
    ] = 60.0,
    body_read_timeout_s: Annotated[
        float, typer.Option(help="A request body must arrive within this (408 after).")
    ] = 10.0,
    upstream_first_byte_timeout_s: Annotated[
        float, typer.Option(help="A replica must answer (a stream: its first token) within "
                            "this, or the request fails over and the replica backs off.")
    ] = 60.0,
    upstream_read_timeout_s: Annotated[
        float, typer.Option(help="Longest gap in a replica's stream once a token is out.")
    ] = 60.0,
    replica_backoff_s: Annotated[
        float, typer.Option(help="How long a replica that did not answer stays out.")
    ] = 30.0,
    kv_events: front.KvEvents = None,
    kv_events_port: front.KvEventsPort = None,
    log_level: front.LogLevel = "INFO",
) -> None:
    """Route each tenant to its home replicas (rendezvous, headroom spill, cache-aware).

    With KVFLEET_ROUTER_SECRET[_FILE] it signs each request's tenant for its replica.
    Replicas holding that secret accept a tenant only so signed (docs/security.md)."""
    from kvfleet_runtime.api import run_app
    from kvfleet_runtime.router import RouterState, create_router_app

    for name, value in (("--header-read-timeout-s", header_read_timeout_s),
                        ("--body-read-timeout-s", body_read_timeout_s),
                        ("--upstream-first-byte-timeout-s", upstream_first_byte_timeout_s),
                        ("--upstream-read-timeout-s", upstream_read_timeout_s),
                        ("--replica-backoff-s", replica_backoff_s)):
        if not 0 < value <= 3600:
            fail(f"{name} must be in (0, 3600], got {value}")
    if not 1 <= upstream_max_connections_per_replica <= upstream_max_connections:
        fail("need 1 <= --upstream-max-connections-per-replica "
             f"({upstream_max_connections_per_replica}) <= --upstream-max-connections "
             f"({upstream_max_connections})")
    inputs = front.picker_inputs(
        keys=keys, fleet_config=fleet_config, replica=replica, redis_url=redis_url,
        redis_cluster_urls=redis_cluster_urls, hint_lookup_budget_s=hint_lookup_budget_s,
        redis_max_connections=redis_max_connections, k=k,
        occupancy_threshold=occupancy_threshold, recompute_s_per_token=recompute_s_per_token,
        poll_interval_s=poll_interval_s, tokenizer=tokenizer, kv_events=kv_events,
        kv_events_port=kv_events_port)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    state = RouterState(
        view=inputs.view,
        keys=inputs.keys,
        index=inputs.index,
        poll_interval_s=poll_interval_s,
        tokenizer=inputs.tokenizer,
        router_secret=inputs.router_secret,
        header_read_timeout_s=header_read_timeout_s,
        body_read_timeout_s=body_read_timeout_s,
        upstream_first_byte_timeout_s=upstream_first_byte_timeout_s,
        upstream_read_timeout_s=upstream_read_timeout_s,
        replica_backoff_s=replica_backoff_s,
        upstream_max_connections=upstream_max_connections,
        upstream_max_connections_per_replica=upstream_max_connections_per_replica,
        kv_events=inputs.kv_events,
        kv_event_endpoints=inputs.kv_event_endpoints,
        kv_events_port=inputs.kv_events_port,
    )
    run_app(create_router_app(state), host=host, port=port)
