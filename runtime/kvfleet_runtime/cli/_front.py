"""What the two fronts (`kvfleet router`, `kvfleet epp`) share on the command line: the options
that feed the picker, their checks, and the picker's inputs built from them (one home each)."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvfleet_runtime.cli._app import fail
from kvfleet_runtime.pools import REDIS_MAX_CONNECTIONS

if TYPE_CHECKING:
    from kvfleet_runtime.affinity import ApiKeyMap
    from kvfleet_runtime.fleet.hint_index import HintIndex
    from kvfleet_runtime.picker import FleetView, KvEventViews
    from kvfleet_runtime.tokenizer import Tokenizer

__all__ = ["PickerInputs", "named_urls", "picker_inputs", "redis_url_from"]

REDIS_URL_ENV = "KVFLEET_REDIS_URL"
REDIS_PASSWORD_ENV = "KVFLEET_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "KVFLEET_REDIS_PASSWORD_FILE"

Keys = Annotated[Path, typer.Option(help="API keys file (YAML: tenants: tenant -> list of keys).")]
FleetConfig = Annotated[
    Path | None, typer.Option(help="The operator's fleet config file (watched).")]
Replicas = Annotated[
    list[str] | None,
    typer.Option(help="NAME=URL of a replica; used when no fleet config lists replicas.")]
RedisUrl = Annotated[
    str | None, typer.Option(help="Hint index for the cache-aware override (redis://host...); "
                             "default $KVFLEET_REDIS_URL. A password goes in KVFLEET_REDIS_URL "
                             "or KVFLEET_REDIS_PASSWORD[_FILE], never on the command line.")]
RedisClusterUrls = Annotated[
    str | None,
    typer.Option(envvar="KVFLEET_REDIS_CLUSTER_URLS",
                 help="Hint index on a Redis Cluster: seed node URLs, comma-separated (wins over "
                 "--redis-url).")]
HintLookupBudget = Annotated[
    float,
    typer.Option(envvar="KVFLEET_HINT_LOOKUP_BUDGET_S",
                 help="A hint lookup slower than this is skipped (override off for that "
                 "request).")]
RedisMaxConnections = Annotated[
    int,
    typer.Option(envvar="KVFLEET_REDIS_MAX_CONNECTIONS",
                 help="Connections to the hint index (to each master of a cluster); a lookup "
                 "that finds them all busy is skipped.")]
HomesK = Annotated[int, typer.Option("--k", help="Home replicas per tenant (config overrides).")]
OccupancyThreshold = Annotated[
    float, typer.Option(help="Spill when every home's KV occupancy is at or above this.")]
RecomputeCost = Annotated[
    float | None,
    typer.Option(help="Prefill seconds per token; enables the cache-aware override.")]
PollInterval = Annotated[float, typer.Option(help="Replica load poll period.")]
TokenizerDir = Annotated[
    Path | None,
    typer.Option(help="The model folder (or its tokenizer files): text prompts are tokenized for "
                 "the cache-aware override only while the replicas report this tokenizer.")]
KvEvents = Annotated[
    list[str] | None,
    typer.Option(help="NAME=tcp://host:port (or ipc://path): subscribe to that vLLM replica's KV "
                 "events (its --kv-events-config endpoint), so the cache-aware override knows "
                 "what it holds in its own cache.")]
KvEventsPort = Annotated[
    int | None,
    typer.Option(help="Subscribe to every vLLM replica's KV events at its URL's host on this "
                 "port (--kv-events wins for the replicas it names).")]
LogLevel = Annotated[str, typer.Option(help="Python logging level.")]

DEFAULT_HINT_LOOKUP_BUDGET_S = 0.002
DEFAULT_HOMES_K = 3
DEFAULT_OCCUPANCY_THRESHOLD = 0.85
DEFAULT_REDIS_MAX_CONNECTIONS = REDIS_MAX_CONNECTIONS


def named_urls(items: list[str], flag: str, schemes: tuple[str, ...], expects: str
               ) -> dict[str, str]:
    """`NAME=URL` options (one per replica), each URL in one of `schemes`, each name once; a
    name is an assertion's audience, so it holds no comma and no space."""
    urls: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(schemes):
            fail(f"{flag} expects {expects}, got {item!r}")
        if any(c == "," or c.isspace() for c in name):
            fail(f"{flag} name {name!r} holds a comma or a space")
        if name in urls:
            fail(f"{flag} {name!r} given twice")
        urls[name] = url
    return urls


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


@dataclass(frozen=True)
class PickerInputs:
    """What both fronts hand their state: the picker's and the tenancy's parts."""

    view: FleetView
    keys: ApiKeyMap
    router_secret: bytes | None
    index: HintIndex | None
    tokenizer: Tokenizer | None
    kv_events: KvEventViews | None
    kv_event_endpoints: dict[str, str]
    kv_events_port: int | None


def picker_inputs(
    *, keys: Path, fleet_config: Path | None, replica: list[str] | None, redis_url: str | None,
    redis_cluster_urls: str | None, hint_lookup_budget_s: float, redis_max_connections: int,
    k: int, occupancy_threshold: float, recompute_s_per_token: float | None,
    poll_interval_s: float, tokenizer: Path | None, kv_events: list[str] | None,
    kv_events_port: int | None,
) -> PickerInputs:
    """The shared options checked (bad input: one line and exit 2) and composed."""
    from kvfleet_runtime.affinity import load_api_keys
    from kvfleet_runtime.auth import hint_key, read_router_secret
    from kvfleet_runtime.fleet.hint_index import (
        RedisClusterHintIndex,
        RedisHintIndex,
        split_seed_urls,
    )
    from kvfleet_runtime.picker import FleetView, KvEventViews
    from kvfleet_runtime.tokenizer import load_tokenizer

    if not 1 <= k <= 16:
        fail(f"--k must be in [1, 16], got {k}")
    if not 0 < occupancy_threshold <= 1:
        fail(f"--occupancy-threshold must be in (0, 1], got {occupancy_threshold}")
    if poll_interval_s <= 0:
        fail(f"--poll-interval-s must be > 0, got {poll_interval_s}")
    if recompute_s_per_token is not None and recompute_s_per_token <= 0:
        fail(f"--recompute-s-per-token must be > 0, got {recompute_s_per_token}")
    replicas = named_urls(replica or [], "--replica", ("http://", "https://"),
                          "NAME=http://host:port")
    event_endpoints = named_urls(kv_events or [], "--kv-events", ("tcp://", "ipc://"),
                                 "NAME=tcp://host:port (or NAME=ipc://path)")
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
    view = FleetView(static_replicas=replicas, config_path=fleet_config, k=k,
                     occupancy_threshold=occupancy_threshold,
                     recompute_s_per_token=recompute_s_per_token)
    return PickerInputs(
        view=view, keys=api_keys, router_secret=router_secret, index=index,
        tokenizer=own_tokenizer,
        kv_events=KvEventViews() if event_endpoints or kv_events_port is not None else None,
        kv_event_endpoints=event_endpoints, kv_events_port=kv_events_port)
