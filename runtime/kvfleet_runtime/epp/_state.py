"""The EPP's small state: its settings, the picker and tenancy it composes, its own metrics (the
decision's are the picker's, under the same names as the router's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfleet_runtime.affinity import ApiKeyMap
from kvfleet_runtime.fleet.hint_index import HintIndex
from kvfleet_runtime.picker import FleetView, KvEventViews, Picker, Tenancy
from kvfleet_runtime.tokenizer import Tokenizer

__all__ = ["EppState"]

PICK_BUCKETS_S = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2,
                  2.5e-2, 5e-2, 0.1, 0.25)


@dataclass
class EppState:
    view: FleetView
    keys: ApiKeyMap
    index: HintIndex | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    tokenizer: Tokenizer | None = None
    router_secret: bytes | None = None
    """Signs the tenant assertions and vLLM's salt, as the router's does."""
    kv_events: KvEventViews | None = None
    kv_event_endpoints: dict[str, str] = field(default_factory=dict)
    kv_events_port: int | None = None
    max_hint_blocks: int = 512
    max_fallbacks: int = 2
    """Addresses after the pick in the destination list: Envoy's retries go there in order."""
    max_body_bytes: int = 1 << 20
    """A larger request body is refused with 413 (the replicas' default)."""
    poll_interval_s: float = 0.5
    config_poll_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_fallbacks < 0:
            raise ValueError(f"max_fallbacks must be >= 0, got {self.max_fallbacks}")
        r = self.registry
        self.tenancy = Tenancy(self.keys, self.router_secret)
        self.view.set_tenants(self.keys.tenants)
        self.picker = Picker(
            self.view, index=self.index, kv_events=self.kv_events, tokenizer=self.tokenizer,
            router_secret=self.router_secret, kv_event_endpoints=self.kv_event_endpoints,
            kv_events_port=self.kv_events_port, max_hint_blocks=self.max_hint_blocks,
            max_fallbacks=self.max_fallbacks, registry=r)
        self.m_requests = Counter(
            "kvfleet_epp_requests", "Requests the gateway asked about, by outcome: picked "
            "(cache-aware), routed (any ready replica: not a completion, or no body to read), "
            "unauthorized (401 here), refused (another 4xx here), no_replica (503 here).",
            ["outcome"], registry=r)
        self.m_pick = Histogram(
            "kvfleet_epp_pick_seconds",
            "From the request's last byte at the EPP to the destination's answer (parse, "
            "tenant, the picker's decision, assertions).", buckets=PICK_BUCKETS_S, registry=r)
        self.m_responses = Counter(
            "kvfleet_epp_responses", "Answers the gateway relayed, by HTTP status (the served "
            "replica's, after Envoy's retries).", ["status"], registry=r)
        self.m_usage = Counter(
            "kvfleet_epp_usage_tokens", "Tokens in the answers' usage: prompt, of them cached "
            "(the replica's prefix hits), completion.", ["kind"], registry=r)
        self.m_streams = Gauge(
            "kvfleet_epp_streams", "ext_proc streams open (requests in flight at the gateway).",
            registry=r)
