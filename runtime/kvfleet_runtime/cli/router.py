"""`kvfleet router`: the fleet's OpenAI-compatible front door."""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from kvfleet_runtime.cli._app import app, fail
from kvfleet_runtime.pools import (
    REDIS_MAX_CONNECTIONS,
    UPSTREAM_MAX_CONNECTIONS,
    UPSTREAM_MAX_CONNECTIONS_PER_REPLICA,
)

__all__ = ["router"]


def _parse_named_urls(
    items: list[str], flag: str, schemes: tuple[str, ...], expects: str
) -> dict[str, str]:
    """`NAME=URL` options (one per replica), each URL in one of `schemes`, each name once."""
    urls: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(schemes):
            fail(f"{flag} expects {expects}, got {item!r}")
        if name in urls:
            fail(f"{flag} {name!r} given twice")
        urls[name] = url
    return urls


REDIS_URL_ENV = "KVFLEET_REDIS_URL"
REDIS_PASSWORD_ENV = "KVFLEET_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "KVFLEET_REDIS_PASSWORD_FILE"


def redis_url_from(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The hint index URL: `--redis-url` (which must not hold a password: argv is in every
    process listing) or `KVFLEET_REDIS_URL`, with the password from `KVFLEET_REDIS_PASSWORD` or
    the file `KVFLEET_REDIS_PASSWORD_FILE` when the URL has none."""
    if flag is not None and urllib.parse.urlsplit(flag).password:
        raise ValueError(f"--redis-url must not hold a password (it would show in the process "
                         f"list): set {REDIS_URL_ENV}, or {REDIS_PASSWORD_ENV}[_FILE]")
    url = flag or environ.get(REDIS_URL_ENV) or None
    if url is None:
        return None
    password = environ.get(REDIS_PASSWORD_ENV) or None
    path = environ.get(REDIS_PASSWORD_FILE_ENV)
    if password is None and path:
        try:
            password = Path(path).read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise ValueError(f"{REDIS_PASSWORD_FILE_ENV} {path}: {exc.strerror or exc}") from None
    parts = urllib.parse.urlsplit(url)
    if password is None or parts.password:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = urllib.parse.quote(parts.username or "", safe="")
    auth = f"{user}:{urllib.parse.quote(password, safe='')}@"
    return urllib.parse.urlunsplit(parts._replace(netloc=auth + host))


@app.command()
def router(
    keys: Annotated[
        Path, typer.Option(help="API keys file (YAML: tenants: tenant -> list of keys).")
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    fleet_config: Annotated[
        Path | None, typer.Option(help="The operator's fleet config file (watched).")
    ] = None,
    replica: Annotated[
        list[str] | None,
        typer.Option(help="NAME=URL of a replica; used when no fleet config lists replicas."),
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Hint index for the cache-aware override (redis://host...)"
                                 "; default $KVFLEET_REDIS_URL. A password goes in "
                                 "KVFLEET_REDIS_URL or KVFLEET_REDIS_PASSWORD[_FILE], never "
                                 "on the command line.")
    ] = None,
    redis_cluster_urls: Annotated[
        str | None,
        typer.Option(envvar="KVFLEET_REDIS_CLUSTER_URLS",
                     help="Hint index on a Redis Cluster: seed node URLs, comma-separated "
                     "(wins over --redis-url)."),
    ] = None,
    hint_lookup_budget_s: Annotated[
        float,
        typer.Option(envvar="KVFLEET_HINT_LOOKUP_BUDGET_S",
                     help="A hint lookup slower than this is skipped (override off for that "
                     "request)."),
    ] = 0.002,
    redis_max_connections: Annotated[
        int,
        typer.Option(envvar="KVFLEET_REDIS_MAX_CONNECTIONS",
                     help="Connections to the hint index (to each master of a cluster); a "
                     "lookup that finds them all busy is skipped."),
    ] = REDIS_MAX_CONNECTIONS,
    upstream_max_connections_per_replica: Annotated[
        int, typer.Option(help="Connections to one replica; requests beyond wait for one.")
    ] = UPSTREAM_MAX_CONNECTIONS_PER_REPLICA,
    upstream_max_connections: Annotated[
        int, typer.Option(help="Connections to all replicas together.")
    ] = UPSTREAM_MAX_CONNECTIONS,
    k: Annotated[int, typer.Option(help="Home replicas per tenant (config overrides).")] = 3,
    occupancy_threshold: Annotated[
        float, typer.Option(help="Spill when every home's KV occupancy is at or above this.")
    ] = 0.85,
    recompute_s_per_token: Annotated[
        float | None,
        typer.Option(help="Prefill seconds per token; enables the cache-aware override."),
    ] = None,
    poll_interval_s: Annotated[float, typer.Option(help="Replica load poll period.")] = 0.5,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="The model folder (or its tokenizer files): text prompts are tokenized "
                     "for the cache-aware override only while the replicas report this "
                     "tokenizer."),
    ] = None,
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
    kv_events: Annotated[
        list[str] | None,
        typer.Option(help="NAME=tcp://host:port (or ipc://path): subscribe to that vLLM "
                     "replica's KV events (its --kv-events-config endpoint), so the cache-aware "
                     "override knows what it holds in its own cache."),
    ] = None,
    kv_events_port: Annotated[
        int | None,
        typer.Option(help="Subscribe to every vLLM replica's KV events at its URL's host on "
                     "this port (--kv-events wins for the replicas it names)."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Python logging level.")] = "INFO",
) -> None:
    """Route each tenant to its home replicas (rendezvous, headroom spill, cache-aware).

    With KVFLEET_ROUTER_SECRET[_FILE] it signs each request's tenant for its replica.
    Replicas holding that secret accept a tenant only so signed (docs/security.md)."""
    from kvfleet_runtime.affinity import load_api_keys
    from kvfleet_runtime.api import run_app
    from kvfleet_runtime.auth import hint_key, read_router_secret
    from kvfleet_runtime.fleet.hint_index import (
        HintIndex,
        RedisClusterHintIndex,
        RedisHintIndex,
        split_seed_urls,
    )
    from kvfleet_runtime.picker import FleetView, KvEventViews
    from kvfleet_runtime.router import RouterState, create_router_app
    from kvfleet_runtime.tokenizer import load_tokenizer

    if not 1 <= k <= 16:
        fail(f"--k must be in [1, 16], got {k}")
    if not 0 < occupancy_threshold <= 1:
        fail(f"--occupancy-threshold must be in (0, 1], got {occupancy_threshold}")
    for name, value in (("--header-read-timeout-s", header_read_timeout_s),
                        ("--body-read-timeout-s", body_read_timeout_s),
                        ("--upstream-first-byte-timeout-s", upstream_first_byte_timeout_s),
                        ("--upstream-read-timeout-s", upstream_read_timeout_s),
                        ("--replica-backoff-s", replica_backoff_s)):
        if not 0 < value <= 3600:
            fail(f"{name} must be in (0, 3600], got {value}")
    if poll_interval_s <= 0:
        fail(f"--poll-interval-s must be > 0, got {poll_interval_s}")
    if recompute_s_per_token is not None and recompute_s_per_token <= 0:
        fail(f"--recompute-s-per-token must be > 0, got {recompute_s_per_token}")
    replicas = _parse_named_urls(
        replica or [], "--replica", ("http://", "https://"), "NAME=http://host:port"
    )
    event_endpoints = _parse_named_urls(
        kv_events or [],
        "--kv-events",
        ("tcp://", "ipc://"),
        "NAME=tcp://host:port (or NAME=ipc://path)",
    )
    if kv_events_port is not None and not 0 < kv_events_port < 65536:
        fail(f"--kv-events-port must be in [1, 65535], got {kv_events_port}")
    try:
        redis_url = redis_url_from(redis_url, os.environ)
    except ValueError as exc:
        fail(str(exc))
    if fleet_config is None and not replicas:
        fail("give --fleet-config or at least one --replica NAME=URL")
    try:
        api_keys = load_api_keys(keys)
        router_secret = read_router_secret()
    except ValueError as exc:
        fail(str(exc))
    try:
        own_tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
    except ValueError as exc:
        fail(f"--tokenizer: {exc}")
    if not hint_lookup_budget_s > 0:
        fail(f"--hint-lookup-budget-s must be > 0, got {hint_lookup_budget_s}")
    if redis_max_connections < 1:
        fail(f"--redis-max-connections must be >= 1, got {redis_max_connections}")
    if not 1 <= upstream_max_connections_per_replica <= upstream_max_connections:
        fail("need 1 <= --upstream-max-connections-per-replica "
             f"({upstream_max_connections_per_replica}) <= --upstream-max-connections "
             f"({upstream_max_connections})")
    budget: dict[str, Any] = {"lookup_budget_s": hint_lookup_budget_s,
                              "max_connections": redis_max_connections,
                              "hint_key": hint_key(router_secret)}
    index: HintIndex | None = (
        RedisHintIndex.from_url(redis_url, **budget) if redis_url else None)
    seeds = split_seed_urls(redis_cluster_urls or "")
    if seeds:
        try:
            index = RedisClusterHintIndex.from_urls(seeds, **budget)
        except ValueError as exc:
            fail(f"--redis-cluster-urls: {exc}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    view = FleetView(
        static_replicas=replicas,
        config_path=fleet_config,
        k=k,
        occupancy_threshold=occupancy_threshold,
        recompute_s_per_token=recompute_s_per_token,
    )
    state = RouterState(
        view=view,
        keys=api_keys,
        index=index,
        poll_interval_s=poll_interval_s,
        tokenizer=own_tokenizer,
        router_secret=router_secret,
        header_read_timeout_s=header_read_timeout_s,
        body_read_timeout_s=body_read_timeout_s,
        upstream_first_byte_timeout_s=upstream_first_byte_timeout_s,
        upstream_read_timeout_s=upstream_read_timeout_s,
        replica_backoff_s=replica_backoff_s,
        upstream_max_connections=upstream_max_connections,
        upstream_max_connections_per_replica=upstream_max_connections_per_replica,
        kv_events=KvEventViews() if event_endpoints or kv_events_port is not None else None,
        kv_event_endpoints=event_endpoints,
        kv_events_port=kv_events_port,
    )
    run_app(create_router_app(state), host=host, port=port)
