"""What the dashboard shows: each panel's title, unit and PromQL, in one table.

The metric names are the product's (`kvfleet_cache_*`: the cache's collector; `kvfleet_replica_*`:
the engine; `kvfleet_t2_*` and `kvfleet_replica_tier_enabled`: the fleet tier's collector;
`kvfleet_nvme_*`: T3; `kvfleet_router_*`: the router). The rollout panel is the operator's own
gate (`kvfleet_operator.api.DEFAULT_HIT_RATE_QUERY`: matched over looked-up tokens over 1 minute)
for the canary's pods and for the others, and the line the canary must reach: the ModelRollout's
`recoveryPercent` (default 90) of the baseline.

Queries use the dashboard's variables `$namespace` and `$gate_percent` and Grafana's
`$__rate_interval`; `render_expr` fills them in for a Prometheus that is asked directly (the tests,
the screenshot).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvfleet_runtime.wire import BLOCK_SIZE

__all__ = ["PANELS", "ROWS", "VARIABLES", "Panel", "Target", "render_expr"]


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    row: str
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"
    """"timeseries" or "state" (a state timeline: on / off)."""
    mappings: dict[str, str] = field(default_factory=dict)
    """Value -> text, for a state panel."""


NS = 'namespace=~"$namespace"'
CANARY = 'pod=~".+-canary-.+"'
BASELINE = 'pod!~".+-canary-.+"'
RATE = "[$__rate_interval]"

VARIABLES = {"namespace": ".*", "gate_percent": "90"}
"""The dashboard's own variables and the values `render_expr` gives them by default (the
ModelRollout's `recoveryPercent` default is 90)."""


def _ratio(num: str, den: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({num}{RATE})) / sum{group} (rate({den}{RATE}))"


def _gate(selector: str) -> str:
    """The operator's gate query (1-minute rates) over the pods `selector` picks."""
    return (f"sum(rate(kvfleet_cache_matched_tokens_total{{{NS},{selector}}}[1m])) / "
            f"sum(rate(kvfleet_cache_lookup_tokens_total{{{NS},{selector}}}[1m]))")


_PROMPT_TOKENS = f"scalar(sum(rate(kvfleet_replica_prompt_tokens_total{{{NS}}}{RATE})))"

PANELS: tuple[Panel, ...] = (
    Panel("Cache", "Fleet token hit rate",
          "Prompt tokens served from the prefix cache over prompt tokens looked up, all replicas.",
          "percentunit",
          (Target(_ratio(f"kvfleet_cache_matched_tokens_total{{{NS}}}",
                         f"kvfleet_cache_lookup_tokens_total{{{NS}}}"), "fleet"),)),
    Panel("Cache", "Hit rate by tier",
          "Share of prompt tokens by the coldest tier a hit read (t0: GPU, t1: host memory). "
          "Blocks fetched from a peer (T2) or read from NVMe (T3) land in t0/t1 first, so their "
          "lines are also inside t0/t1's.",
          "percentunit",
          (Target(f"sum by (tier) (rate(kvfleet_replica_cached_prompt_tokens_total{{{NS}}}{RATE}))"
                  f" / {_PROMPT_TOKENS}", "{{tier}}"),
           Target(f"{BLOCK_SIZE} * sum(rate(kvfleet_t2_fetched_blocks_total{{{NS}}}{RATE})) / "
                  f"{_PROMPT_TOKENS}", "t2 (fetched from peers)"),
           Target(f"{BLOCK_SIZE} * sum(rate(kvfleet_nvme_blocks_served_total{{{NS}}}{RATE})) / "
                  f"{_PROMPT_TOKENS}", "t3 (read from NVMe)"))),
    Panel("Cache", "Hit rate per tenant",
          "Per-tenant series are on a replica's /metrics only for a scrape that presents the "
          "metrics token (the chart's ServiceMonitor does; docs/security.md): without it this "
          "panel stays empty.",
          "percentunit",
          (Target(_ratio(f"kvfleet_cache_matched_tokens_total{{{NS}}}",
                         f"kvfleet_cache_lookup_tokens_total{{{NS}}}", by="tenant"),
                  "{{tenant}}"),)),
    Panel("Cache", "Prefill tokens saved",
          "Prompt tokens per second whose KV came from the cache, beside those computed.",
          "short",
          (Target(f"sum(rate(kvfleet_replica_cached_prompt_tokens_total{{{NS}}}{RATE}))",
                  "saved (from cache)"),
           Target(f"sum(rate(kvfleet_replica_prefilled_tokens_total{{{NS}}}{RATE}))",
                  "computed"))),
    Panel("Latency", "TTFT p50 / p99, hit vs miss",
          "Submit to first token on the replicas: requests with any cached prompt token (hit) "
          "and with none (miss).",
          "s",
          tuple(Target(f"histogram_quantile({q}, sum by (le, cache) (rate("
                       f"kvfleet_replica_time_to_first_token_seconds_bucket{{{NS}}}{RATE})))",
                       f"p{round(q * 100)} {{{{cache}}}}") for q in (0.5, 0.99))),
    Panel("Tiers", "T2 bytes fetched",
          "KV bytes per second the replicas fetched from their peers.",
          "Bps",
          (Target(f"sum(rate(kvfleet_t2_fetched_bytes_total{{{NS}}}{RATE}))", "fetched"),)),
    Panel("Tiers", "T2 fetch latency",
          "Transfer time of each run landed from a peer (request to its last verified byte).",
          "s",
          tuple(Target(f"histogram_quantile({q}, sum by (le) (rate("
                       f"kvfleet_t2_fetch_seconds_bucket{{{NS}}}{RATE})))",
                       f"p{round(q * 100)}") for q in (0.5, 0.99))),
    Panel("Tiers", "Evictions and admission refusals",
          "Blocks per second evicted out of each tier, refused by admission and dropped from a "
          "full store queue.",
          "short",
          (Target(f"sum by (tier) (rate(kvfleet_cache_tier_evictions_total{{{NS}}}{RATE}))",
                  "evicted from {{tier}}"),
           Target(f"sum(rate(kvfleet_cache_admissions_refused_total{{{NS}}}{RATE}))",
                  "admission refused"),
           Target(f"sum(rate(kvfleet_cache_store_drops_total{{{NS}}}{RATE}))",
                  "store queue drops"))),
    Panel("Tiers", "Break-even verdict per tier",
          "Whether the fleet config the operator published turns each tier on: its "
          "KVCachePolicy decides every Auto tier by the break-even arithmetic "
          "(`kubectl get kvcachepolicies -o wide` shows the reason).",
          "short",
          (Target(f"max by (tier) (kvfleet_replica_tier_enabled{{{NS}}})", "{{tier}}"),),
          kind="state", mappings={"0": "off", "1": "on"}),
    Panel("Routing", "Router decisions",
          "Requests per second by the router's reason (home, spill, warm, ...).",
          "reqps",
          (Target(f"sum by (reason) (rate(kvfleet_router_decisions_total{{{NS}}}{RATE}))",
                  "{{reason}}"),)),
    Panel("Routing", "Spill rate",
          "Share of the router's last decisions that left the tenant's home replicas.",
          "percentunit",
          (Target(f"max(kvfleet_router_spill_rate{{{NS}}})", "spill rate"),)),
    Panel("Rollout", "ModelRollout: canary vs baseline, and the gate",
          "The operator's gate query for the canary's pods and for the others; the canary "
          "passes a step when it reaches the gate line (recoveryPercent of the baseline) within "
          "the gate's window, else the rollout rolls back.",
          "percentunit",
          (Target(_gate(CANARY), "canary"),
           Target(_gate(BASELINE), "baseline"),
           Target(f"$gate_percent / 100 * ({_gate(BASELINE)})",
                  "gate ($gate_percent% of baseline)"))),
)

ROWS: tuple[str, ...] = tuple(dict.fromkeys(p.row for p in PANELS))


def render_expr(expr: str, variables: dict[str, str] | None = None,
                rate_interval: str = "1m") -> str:
    """`expr` with the dashboard's variables and `$__rate_interval` filled in, as Grafana would
    (for asking Prometheus directly)."""
    values = {**VARIABLES, **(variables or {}), "__rate_interval": rate_interval}
    return re.sub(r"\$(\w+)", lambda m: values.get(m.group(1), m.group(0)), expr)
