"""The router's small state: its settings, the picker and tenancy it composes, the upstream
session, and the proxy's own metrics (the decision's are the picker's)."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvfleet_runtime.affinity import ApiKeyMap
from kvfleet_runtime.api import ListenerLimits
from kvfleet_runtime.fleet.hint_index import HintIndex
from kvfleet_runtime.picker import FleetView, KvEventViews, Picker, Tenancy
from kvfleet_runtime.pools import UPSTREAM_MAX_CONNECTIONS, UPSTREAM_MAX_CONNECTIONS_PER_REPLICA
from kvfleet_runtime.tokenizer import Tokenizer

__all__ = ["STATE", "RouterState"]


@dataclass
class RouterState:
    view: FleetView
    keys: ApiKeyMap
    index: HintIndex | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    max_hint_blocks: int = 512
    max_attempts: int = 3
    upstream_connect_timeout_s: float = 1.0
    upstream_timeout_s: float = 600.0
    """Longest a proxied request may take in all (a stream included)."""
    upstream_first_byte_timeout_s: float = 60.0
    """A replica must answer (a non-streamed answer whole, a stream its first token) within
    this, or the request fails over and the replica is kept out for `replica_backoff_s`:
    nginx's `proxy_read_timeout`. A non-streamed generation longer than this needs a larger
    value (or `stream: true`)."""
    upstream_read_timeout_s: float = 60.0
    """Once a stream's first token is out: the longest gap between two reads before the stream
    is ended with an error event (nginx's `proxy_read_timeout`)."""
    replica_backoff_s: float = 30.0
    """How long a replica that took its request and did not answer (or answered a non-JSON 5xx)
    stays out of decisions, whatever its load reports say: Envoy's outlier detection
    `base_ejection_time`."""
    max_body_bytes: int = 1 << 20
    """Larger bodies are refused with 413 before anything is forwarded (the replicas' default)."""
    body_read_timeout_s: float = 10.0
    """A body must arrive within this time, or the request is refused with 408."""
    header_read_timeout_s: float = ListenerLimits().header_timeout_s
    """A request head must be complete within this; also the idle keep-alive time
    (`api.ListenerLimits`)."""
    spill_window: int = 1000
    poll_interval_s: float = 0.5
    config_poll_s: float = 1.0
    session: aiohttp.ClientSession | None = None
    upstream_max_connections: int = UPSTREAM_MAX_CONNECTIONS
    upstream_max_connections_per_replica: int = UPSTREAM_MAX_CONNECTIONS_PER_REPLICA
    """The caps of the upstream pool the router makes (not of a `session` given to it)."""
    tokenizer: Tokenizer | None = None
    """The model's tokenizer (`kvfleet router --tokenizer DIR`), for text prompts; used only while
    the replicas report the same tokenizer name."""
    router_secret: bytes | None = None
    """Signs the tenant assertion sent with every proxied request (`kvfleet_runtime.auth`);
    None: the tenant goes unsigned and only replicas without a router secret (tenant `default`,
    loopback) accept it."""
    kv_events: KvEventViews | None = None
    """What each vLLM replica holds in its own KV cache, from its KV events (None: not
    subscribed); the cache-aware override takes the larger of this and the hint index."""
    kv_event_endpoints: dict[str, str] = field(default_factory=dict)
    """Replica name -> ZMQ endpoint of its KV events (`--kv-events`)."""
    kv_events_port: int | None = None
    """Every vLLM replica's events at its URL's host on this port (`--kv-events-port`)."""

    def __post_init__(self) -> None:
        if not 1 <= self.upstream_max_connections_per_replica <= self.upstream_max_connections:
            raise ValueError(
                "upstream connection caps: need 1 <= per replica "
                f"({self.upstream_max_connections_per_replica}) <= total "
                f"({self.upstream_max_connections})")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        r = self.registry
        # The composition: one secret signs the assertion, the body's salt and the KV views'.
        self.tenancy = Tenancy(self.keys, self.router_secret)
        self.view.set_tenants(self.keys.tenants)
        self.picker = Picker(
            self.view, index=self.index, kv_events=self.kv_events, tokenizer=self.tokenizer,
            router_secret=self.router_secret, kv_event_endpoints=self.kv_event_endpoints,
            kv_events_port=self.kv_events_port, max_hint_blocks=self.max_hint_blocks,
            max_fallbacks=self.max_attempts - 1, spill_window=self.spill_window, registry=r)
        self.m_requests = Counter(
            "kvfleet_router_requests",
            "Proxied requests by replica and outcome.",
            ["replica", "outcome"],
            registry=r,
        )
        self.m_overhead = Histogram(
            "kvfleet_router_overhead_seconds",
            "Time from request arrival to the upstream request being sent (auth, parse, hint "
            "lookup, decision).",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1),
            registry=r,
        )
        self.m_unauthorized = Counter(
            "kvfleet_router_unauthorized",
            "Requests refused for a missing or unknown API key.",
            registry=r,
        )

    @property
    def spill_rate(self) -> float:
        return self.picker.spill_rate

    @property
    def client(self) -> aiohttp.ClientSession:
        """The upstream pool (made by the app's lifecycle unless given)."""
        assert self.session is not None, "the router app is not running"
        return self.session


STATE = web.AppKey("router_state", RouterState)
"""Where every handler finds the state (`request.app[STATE]`)."""
