"""The `kvfleet.dev/v1alpha1` API: typed specs and statuses of KVCachePolicy and ModelRollout.

These pydantic models are the one source of truth: `crds/*.yaml` are generated from them
(`python -m kvfleet_operator.crdgen`), and the handlers parse what the API server hands them with
the same models. Field names are camelCase on the wire (aliases) and snake_case in Python.

Every field has a description (a docstring under it, `use_attribute_docstrings`) with its unit;
crdgen appends its default, so `kubectl explain` documents the whole API (a test walks both CRDs
and fails on a field without one).

Cross-field rules live twice on purpose: as CEL (`x-kubernetes-validations`) so that the API
server refuses a bad object at `kubectl apply` with the field path, and as validators here so the
pure planners never see one either (an object created before a rule existed, or a unit test).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from kvfleet_runtime.breakeven import GPUS, MEDIA, MODELS, check_tp_degree
from kvfleet_runtime.breakeven.profiles import KVDtype

__all__ = [
    "AdmissionSpec",
    "AffinitySpec",
    "CacheStatsSource",
    "Condition",
    "FleetKind",
    "GateSpec",
    "HistoryEntry",
    "HomeSetSummary",
    "KVCachePolicySpec",
    "KVCachePolicyStatus",
    "LabelSelector",
    "MetricsSpec",
    "ModelRolloutSpec",
    "ModelRolloutStatus",
    "ModelSpec",
    "NvmeTierSpec",
    "PreviousVersion",
    "PrometheusSource",
    "RolloutPhase",
    "RolloutStep",
    "StepResult",
    "StepState",
    "StepStatus",
    "SurgeMode",
    "SurgeSpec",
    "TargetRef",
    "TierDecisionStatus",
    "TierMode",
    "TierSpec",
    "TiersSpec",
]

MEDIUM_NAMES = tuple(MEDIA)
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    out = {"rule": rule, "message": message}
    if field_path is not None:
        out["fieldPath"] = field_path
    return out


def _validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class _Spec(BaseModel):
    """Specs are immutable values; unknown fields are refused (the API server prunes them too)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )


class _Status(BaseModel):
    """Statuses are rebuilt by the planners with `model_copy(update=...)`; fields we do not know
    (a newer operator's) are ignored rather than refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        frozen=True,
        use_attribute_docstrings=True,
    )


# ---------------------------------------------------------------------------------------------
# shared


class LabelSelector(_Spec):
    """Selects the replica pods this policy governs (a subset of metav1.LabelSelector)."""

    match_labels: Annotated[dict[str, str], Field(min_length=1)]
    """Labels every replica pod of the fleet carries (all must match; at least one)."""


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Status):
    """A Kubernetes-style condition."""

    type: Annotated[str, Field(min_length=1, max_length=316)]
    """What the condition is about: Ready, Progressing or Degraded."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: Annotated[str, Field(max_length=1024)] = ""
    """One CamelCase word for the last transition (e.g. Reconciled, InvalidSpec)."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """Why, in words."""
    last_transition_time: Annotated[str, Field(json_schema_extra={"format": "date-time"})] = ""
    """When status last changed value (UTC, RFC 3339)."""
    observed_generation: Annotated[int, Field(ge=0)] = 0
    """The metadata.generation the condition was computed from."""


# ---------------------------------------------------------------------------------------------
# KVCachePolicy


class TierMode(StrEnum):
    """Enabled and Disabled are the user's call; Auto is the break-even arithmetic's."""

    ENABLED = "Enabled"
    DISABLED = "Disabled"
    AUTO = "Auto"


class FleetKind(StrEnum):
    """Interactive fleets build a tier only when it helps latency; batch fleets also when it only
    helps capacity (revision R1)."""

    INTERACTIVE = "Interactive"
    BATCH = "Batch"


def _tp_degree_rules() -> list[dict[str, str]]:
    """CEL twins of `check_tp_degree` for the built-in profiles: one rule per KV head count."""
    by_heads: dict[int, list[str]] = {}
    for name, model in MODELS.items():
        if model.mla is None:  # an MLA latent is not split by heads: any TP degree works
            by_heads.setdefault(model.num_kv_heads, []).append(name)
    rules = []
    for heads, names in sorted(by_heads.items()):
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        quoted = ", ".join(f"'{n}'" for n in names)
        rules.append(
            _cel(
                f"!(self.profile in [{quoted}]) || {heads} % self.tpDegree == 0",
                f"tpDegree must divide the {heads} KV heads of {', '.join(names)} "
                f"({', '.join(map(str, divisors))}): rank r of a replica holds heads "
                f"h % tpDegree == r, so every rank needs the same number of whole heads",
                ".tpDegree",
            )
        )
    return rules


_TP_DEGREE_RULES = _tp_degree_rules()


class ModelSpec(_Spec):
    """The model and hardware the break-even decision is made for."""

    model_config = ConfigDict(json_schema_extra=_validations(*_TP_DEGREE_RULES))
    profile: Annotated[str, Field(json_schema_extra={"enum": list(MODELS)})] = "reference-70b"
    """Built-in model profile (layers, KV heads, head size, parameters) the arithmetic uses."""
    model_id: Annotated[str, Field(max_length=253)] = ""
    """Model id published to the fleet, part of every cache key (empty: the profile's name)."""
    kv_dtype: Annotated[str, Field(json_schema_extra={"enum": [d.value for d in KVDtype]})] = "fp16"
    """Element type of the cached K and V: bytes per token scale with it (fp8: half of fp16)."""
    gpu: Annotated[str, Field(json_schema_extra={"enum": list(GPUS)})] = "h100"
    """GPU profile (dense FLOPS, HBM bandwidth): how fast a replica recomputes a prefix."""
    tp_degree: Annotated[int, Field(ge=1, le=64)] = 4
    """GPUs per replica (tensor parallelism); must divide the model's KV heads (rank r holds
    heads h % tpDegree == r)."""
    prefix_tokens: Annotated[int, Field(ge=16, le=1_048_576)] = 2000
    """Typical cached prefix length in tokens, for the fetch and recompute times reported (the
    break-even bandwidth itself does not depend on it)."""

    @model_validator(mode="after")
    def _tp_divides_kv_heads(self) -> ModelSpec:
        model = MODELS.get(self.profile)
        if model is not None:
            check_tp_degree(model, self.tp_degree)
        return self


class TierSpec(_Spec):
    """One cache tier: on, off, or decided by the break-even arithmetic."""

    mode: TierMode = TierMode.AUTO
    """Enabled, Disabled, or Auto: on when fetching a prefix's KV from the medium is faster than
    recomputing it (and, for a Batch fleet, also when it only adds capacity)."""
    medium: Annotated[str | None, Field(json_schema_extra={"enum": list(MEDIUM_NAMES)})] = None
    """Storage medium profile the decision assumes (unset: the tier's usual one: hbm for device,
    dram-pcie5 for host, rdma-200g for peer, nvme-gen4 for nvme)."""
    measured_bandwidth_g_bps: Annotated[
        float | None, Field(alias="measuredBandwidthGBps", gt=0, le=100_000)
    ] = None
    """Bandwidth measured on your hardware in GB/s (1e9 bytes/s); Auto decides with it instead
    of the medium's profile (unset: the profile, or the fleet's shadow measurement)."""


_MEASURED_ONLY_AUTO = _cel(
    "self.mode == 'Auto' || !has(self.measuredBandwidthGBps)",
    "measuredBandwidthGBps is only used when mode is Auto",
    ".measuredBandwidthGBps",
)


class DeviceTierSpec(TierSpec):
    """One cache tier: on, off, or decided by the break-even arithmetic."""

    model_config = ConfigDict(json_schema_extra=_validations(_MEASURED_ONLY_AUTO))


class NvmeTierSpec(TierSpec):
    """Local NVMe. Off for interactive traffic unless a measurement beats the break-even (R6);
    `shadow` runs the measurement (store, fetch, discard) whatever the mode."""

    model_config = ConfigDict(json_schema_extra=_validations(_MEASURED_ONLY_AUTO))
    shadow: bool = True
    """Measure the tier in the background whatever the mode: store to NVMe, read back, discard,
    record the achieved bandwidth."""


class TiersSpec(_Spec):
    """The four cache tiers of every replica (docs/design.md §1)."""

    device: DeviceTierSpec = DeviceTierSpec()
    """T0: GPU HBM, the engine's own KV blocks."""
    host: DeviceTierSpec = DeviceTierSpec()
    """T1: host DRAM of the replica's node, over PCIe."""
    peer: DeviceTierSpec = DeviceTierSpec()
    """T2: another replica's cache, fetched over the network."""
    nvme: NvmeTierSpec = NvmeTierSpec()
    """T3: local NVMe of the replica's node."""


class AdmissionSpec(_Spec):
    """What a replica's cache stores and pins (published to the fleet ConfigMap)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.hotSightings >= self.minSightings",
                "hotSightings must be >= minSightings",
                ".hotSightings",
            )
        )
    )
    min_sightings: Annotated[int, Field(ge=1, le=16)] = 1
    """Sightings (requests) of a block before it is stored. 1: on first sighting, the cache
    growing stricter by itself while it thrashes (the replica's default); 2 or more keeps one-shot
    prefixes out always."""
    hot_sightings: Annotated[int, Field(ge=2, le=1024)] = 3
    """Sightings from which a small prefix is pinned in GPU memory; >= minSightings."""
    pin_max_tokens: Annotated[int, Field(ge=0, le=1_048_576)] = 2048
    """Longest prefix, in tokens, that may be pinned (0: never pin)."""
    store_queue_size: Annotated[int, Field(ge=1, le=1_048_576)] = 256
    """Pending cache writes (entries) held at once; a full queue drops its least valuable one."""
    thrash_ratio: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Share of offered blocks dropped (0-1) above which the cache is thrashing and admits only
    blocks seen once more than minSightings."""

    @model_validator(mode="after")
    def _hot_after_min(self) -> AdmissionSpec:
        if self.hot_sightings < self.min_sightings:
            raise ValueError(
                f"hotSightings ({self.hot_sightings}) must be >= minSightings "
                f"({self.min_sightings})"
            )
        return self


class AffinitySpec(_Spec):
    """Tenant affinity: where the router sends each tenant."""

    k: Annotated[int, Field(ge=1, le=16)] = 3
    """Replicas in each tenant's home set (rendezvous top-k over the ready replica pods)."""
    occupancy_threshold: Annotated[float, Field(gt=0, le=1)] = 0.85
    """KV occupancy (0-1 of a replica's KV memory) at which the router stops sending a tenant
    to a home and tries the next one."""


class KVCachePolicySpec(_Spec):
    """A cache-aware fleet: which replicas, what model and hardware, which tiers, which knobs."""

    selector: LabelSelector
    """The replica pods this policy governs."""
    replica_port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """TCP port of each replica's HTTP server (published as http://<podIP>:<port>)."""
    fleet: FleetKind = FleetKind.INTERACTIVE
    """Interactive (tiers only where they cut latency) or Batch (also where they add capacity)."""
    model: ModelSpec = ModelSpec()
    """The model and hardware the tier decision is computed for."""
    tiers: TiersSpec = TiersSpec()
    """Per-tier mode, medium and measured bandwidth."""
    admission: AdmissionSpec = AdmissionSpec()
    """Cache admission and pinning knobs of every replica."""
    affinity: AffinitySpec = AffinitySpec()
    """How tenants are spread over the replicas."""
    tenants: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=253)]], Field(max_length=100_000)
    ] = []
    """Tenant ids whose home sets are planned and published (at most 100,000)."""
    platform_prefixes: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=253)]], Field(max_length=1024)
    ] = []
    """Ids of platform-owned prefixes (e.g. a system preamble) whose KV may be shared across
    tenants; no other KV ever is."""
    config_map_name: Annotated[
        str | None, Field(max_length=253, pattern=DNS_LABEL_PATTERN)
    ] = None
    """Name of the fleet ConfigMap the policy publishes (unset: <policy name>-fleet)."""


class TierDecisionStatus(_Status):
    """The decision for one tier."""

    tier: str
    """device, host, peer or nvme."""
    medium: str
    """The medium profile the decision assumed."""
    enabled: bool
    """Whether replicas use the tier."""
    reason: str
    """Why, e.g. "break-even 9.26 GB/s vs measured 6.1 GB/s: off"."""
    profile_g_bps: Annotated[float | None, Field(alias="profileGBps")] = None
    """Bandwidth in GB/s (1e9 bytes/s) of the medium's profile (unset for a tier set by mode)."""
    measured_g_bps: Annotated[float | None, Field(alias="measuredGBps")] = None
    """Bandwidth in GB/s the decision used instead of the profile: the spec's
    measuredBandwidthGBps, else the fleet's shadow measurement (unset: none)."""
    measurement: str = ""
    """Where the measured figure comes from, e.g. "shadow: 3 replica(s), 120 reads, per-read
    bandwidth at p95 concurrency 4" or "spec" (empty: the profile decided)."""


class HomeSetSummary(_Status):
    """The published home sets, summarized (the sets themselves are in the ConfigMap)."""

    num_tenants: int = 0
    """Tenants with a home set."""
    num_replicas: int = 0
    """Ready replica pods the sets were planned over."""
    k: int = 0
    """Replicas per home set."""
    min_tenants_per_replica: int = 0
    """Fewest tenants any replica is home to."""
    max_tenants_per_replica: int = 0
    """Most tenants any replica is home to."""
    config_map: str = ""
    """The fleet ConfigMap's name."""
    config_hash: str = ""
    """Digest of the published fleet.yaml text: changes exactly when the published config does."""


class KVCachePolicyStatus(_Status):
    """What the operator decided and published."""

    observed_generation: int = 0
    """The metadata.generation this status was computed from."""
    break_even_g_bps: Annotated[float, Field(alias="breakEvenGBps")] = 0.0
    """Bandwidth in GB/s (1e9 bytes/s) at which fetching a prefix's KV takes as long as
    recomputing it, for the spec's model and hardware."""
    break_even: str = ""
    """breakEvenGBps for people, with its unit and 3 significant digits ("9.26 GB/s"): the
    BreakEven column of `kubectl get -o wide`."""
    tiers_summary: str = ""
    """The enabled tiers, comma-separated (none: every tier off)."""
    tiers: list[TierDecisionStatus] = []
    """The decision for every tier, with its reason."""
    home_sets: HomeSetSummary = HomeSetSummary()
    """The published tenant home sets."""
    conditions: list[Condition] = []
    """Ready: whether the last reconcile published (False with InvalidSpec or ConfigTooLarge)."""


# ---------------------------------------------------------------------------------------------
# ModelRollout


class TargetRef(_Spec):
    """The replica Deployment to roll (in the rollout's namespace)."""

    kind: Literal["Deployment"] = "Deployment"
    """Kind of the target; only Deployment."""
    name: Annotated[str, Field(min_length=1, max_length=240, pattern=DNS_LABEL_PATTERN)]
    """Name of the Deployment; its canary is <name>-canary."""
    container: Annotated[str | None, Field(max_length=63)] = None
    """Container that loads the weights (unset: the pod template's first container)."""


class RolloutStep(_Spec):
    """How much of the fleet runs the new weights at this step: a replica count or a percentage
    of the target's replicas (rounded up, at least 1)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "has(self.replicas) != has(self.percent)",
                "a step sets exactly one of replicas or percent",
            )
        )
    )
    replicas: Annotated[int | None, Field(ge=1, le=10_000)] = None
    """Replicas on the new weights at this step (unset: percent gives it)."""
    percent: Annotated[int | None, Field(ge=1, le=100)] = None
    """Percent of the target's replicas on the new weights at this step, rounded up, at least
    1 replica (unset: replicas gives it)."""

    @model_validator(mode="after")
    def _exactly_one(self) -> RolloutStep:
        if (self.replicas is None) == (self.percent is None):
            raise ValueError("a step sets exactly one of replicas or percent")
        return self


DEFAULT_STEPS = (
    RolloutStep(replicas=1),
    RolloutStep(percent=10),
    RolloutStep(percent=50),
    RolloutStep(percent=100),
)


class GateSpec(_Spec):
    """Each step waits until the canary's cache hit rate recovers to `recoveryPercent` of the
    stable version's, within `windowSeconds` of the canary being ready; otherwise it rolls back."""

    recovery_percent: Annotated[int, Field(ge=1, le=100)] = 90
    """Percent of the stable version's cache hit rate the canary must reach to pass a step."""
    window_seconds: Annotated[int, Field(ge=1, le=86_400)] = 1800
    """Seconds from the canary being ready for its hit rate to recover; then it rolls back."""
    hold_seconds: Annotated[int, Field(ge=0, le=86_400)] = 60
    """Minimum seconds in a step's gate before it may pass, even when recovered at once."""
    ready_timeout_seconds: Annotated[int, Field(ge=1, le=86_400)] = 600
    """Seconds for the canary's pods to become ready before the rollout rolls back."""
    check_interval_seconds: Annotated[int, Field(ge=1, le=3600)] = 15
    """Seconds between two evaluations of the gate (sooner when a hold or window ends)."""


class SurgeMode(StrEnum):
    """None: no extra replicas; Fixed: a given number; Computed: from the saved prefill rate."""

    NONE = "None"
    FIXED = "Fixed"
    COMPUTED = "Computed"


class SurgeSpec(_Spec):
    """Extra canary replicas while a step's cache is cold (a rollout is a capacity event).

    Computed: the prefill tokens/s the stable replicas' caches save, times the share of the fleet
    the step moves to the cold canary, divided by one replica's prefill throughput, rounded up."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.mode != 'Fixed' || has(self.replicas)",
                "mode Fixed needs replicas",
                ".replicas",
            ),
            _cel(
                "self.mode != 'Computed' || has(self.replicaPrefillTokensPerSecond)",
                "mode Computed needs replicaPrefillTokensPerSecond",
                ".replicaPrefillTokensPerSecond",
            ),
        )
    )
    mode: SurgeMode = SurgeMode.NONE
    """None, Fixed (surge.replicas) or Computed (from replicaPrefillTokensPerSecond)."""
    replicas: Annotated[int | None, Field(ge=0, le=10_000)] = None
    """Extra canary replicas per step in Fixed mode (required there)."""
    replica_prefill_tokens_per_second: Annotated[float | None, Field(gt=0, le=1e9)] = None
    """Prefill throughput of one replica in tokens/s, for Computed mode (required there)."""
    max_replicas: Annotated[int, Field(ge=0, le=10_000)] = 16
    """Most extra replicas a step ever adds, in any mode."""

    @model_validator(mode="after")
    def _mode_fields(self) -> SurgeSpec:
        if self.mode is SurgeMode.FIXED and self.replicas is None:
            raise ValueError("mode Fixed needs replicas")
        if self.mode is SurgeMode.COMPUTED and self.replica_prefill_tokens_per_second is None:
            raise ValueError("mode Computed needs replicaPrefillTokensPerSecond")
        return self


# The replica's cache exports kvfleet_cache_{lookup,matched}_tokens_total (per tenant).
DEFAULT_HIT_RATE_QUERY = (
    'sum(rate(kvfleet_cache_matched_tokens_total{namespace="${namespace}",pod=~"${pod_regex}"}'
    '[1m])) / sum(rate(kvfleet_cache_lookup_tokens_total{namespace="${namespace}",'
    'pod=~"${pod_regex}"}[1m]))'
)
DEFAULT_SAVED_PREFILL_QUERY = (
    'sum(rate(kvfleet_cache_matched_tokens_total{namespace="${namespace}",pod=~"${pod_regex}"}'
    "[5m]))"
)


class PrometheusSource(_Spec):
    """PromQL templates; `${namespace}`, `${deployment}` and `${pod_regex}` (a regex matching
    exactly the pods the deployment has now, so a deleted pod's series still in the rate window,
    such as a previous rollout's canary, is never counted) are substituted. The hit-rate query
    returns a ratio in [0, 1]."""

    url: Annotated[str, Field(pattern=r"^https?://", max_length=2048)]
    """Base URL of the Prometheus HTTP API (http:// or https://)."""
    hit_rate_query: Annotated[str, Field(min_length=1, max_length=4096)] = DEFAULT_HIT_RATE_QUERY
    """PromQL for a Deployment's cache hit rate, a ratio in [0, 1] (matched over looked-up
    prompt tokens over 1 minute)."""
    saved_prefill_query: Annotated[str, Field(min_length=1, max_length=4096)] = (
        DEFAULT_SAVED_PREFILL_QUERY
    )
    """PromQL for the prefill tokens/s a Deployment's caches save (Computed surge)."""
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 5.0
    """Seconds one query may take."""


class CacheStatsSource(_Spec):
    """Fallback: read each ready pod's `GET /cache/stats` and aggregate its token counters."""

    enabled: bool = True
    """Use the fallback when Prometheus is not configured, unreachable or has no data."""
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """TCP port of the replicas' HTTP server."""
    path: Annotated[str, Field(pattern=r"^/", max_length=1024)] = "/cache/stats"
    """HTTP path of the replicas' cache statistics."""
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 2.0
    """Seconds one read of all the pods may take (they are asked at once; late ones skipped)."""


class MetricsSpec(_Spec):
    """Where the gate's hit rates come from: Prometheus, else each replica's /cache/stats."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "has(self.prometheus) || self.cacheStats.enabled",
                "need a metric source: prometheus, or cacheStats.enabled",
            )
        )
    )
    prometheus: PrometheusSource | None = None
    """Prometheus queries (unset: the cacheStats fallback only)."""
    cache_stats: CacheStatsSource = CacheStatsSource()
    """The replicas' own cumulative counters, the fallback."""

    @model_validator(mode="after")
    def _some_source(self) -> MetricsSpec:
        if self.prometheus is None and not self.cache_stats.enabled:
            raise ValueError("need a metric source: prometheus, or cacheStats.enabled")
        return self


class ModelRolloutSpec(_Spec):
    """Roll new weights onto a replica Deployment as a capacity event: staged, surged, gated."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.targetRef == oldSelf.targetRef",
                "targetRef is immutable; create a new ModelRollout",
                ".targetRef",
            ),
            _cel(
                "self.weightsDigest == oldSelf.weightsDigest",
                "weightsDigest is immutable; create a new ModelRollout",
                ".weightsDigest",
            ),
            _cel(
                "(has(self.image) ? self.image : '') == (has(oldSelf.image) ? oldSelf.image : '')",
                "image is immutable; create a new ModelRollout",
                ".image",
            ),
            _cel(
                "self.steps == oldSelf.steps",
                "steps are immutable; create a new ModelRollout",
                ".steps",
            ),
            _cel("!oldSelf.abort || self.abort", "abort cannot be undone", ".abort"),
            _cel(
                "has(self.steps[size(self.steps) - 1].percent)"
                " && self.steps[size(self.steps) - 1].percent == 100",
                "the last step must be percent: 100",
                ".steps",
            ),
        )
    )
    target_ref: TargetRef
    """The replica Deployment to roll; immutable."""
    weights_digest: Annotated[str, Field(pattern=DIGEST_PATTERN)]
    """Digest of the new weights, sha256:<64 hex>, never a tag; part of every cache key;
    immutable."""
    image: Annotated[str | None, Field(min_length=1, max_length=1024)] = None
    """New container image (unset: keep the target's image); immutable."""
    digest_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=253)] = (
        "KVFLEET_WEIGHTS_DIGEST"
    )
    """Environment variable through which the replica container learns its weights digest."""
    steps: Annotated[list[RolloutStep], Field(min_length=1, max_length=20)] = list(DEFAULT_STEPS)
    """Canary steps, 1 to 20, each a replica count or a percentage; the last is percent: 100;
    immutable."""
    gate: GateSpec = GateSpec()
    """When a step passes: the canary's cache hit rate recovered, within a window."""
    surge: SurgeSpec = SurgeSpec()
    """Extra canary replicas while a step's cache is cold."""
    metrics: MetricsSpec = MetricsSpec()
    """Where the hit rates come from."""
    paused: bool = False
    """Hold the current step: its clocks stop and the workload stays; false resumes it."""
    abort: bool = False
    """Roll back now from any phase (before the first step: touch nothing); cannot be undone."""

    @model_validator(mode="after")
    def _last_step_is_everything(self) -> ModelRolloutSpec:
        if self.steps[-1].percent != 100:
            raise ValueError("the last step must be percent: 100")
        return self


class RolloutPhase(StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    PAUSED = "Paused"
    PROMOTING = "Promoting"
    SUCCEEDED = "Succeeded"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    FAILED = "Failed"


TERMINAL_PHASES = frozenset({RolloutPhase.SUCCEEDED, RolloutPhase.ROLLED_BACK, RolloutPhase.FAILED})


class StepState(StrEnum):
    SCALING = "Scaling"  # waiting for the canary's pods to be ready
    GATING = "Gating"  # window open: waiting for the hit rate to recover


class StepResult(StrEnum):
    RUNNING = "Running"
    PASSED = "Passed"
    TIMED_OUT = "TimedOut"
    NOT_READY = "NotReady"
    ABORTED = "Aborted"


class StepStatus(_Status):
    """One step as it ran: its numbers are fixed when it starts."""

    index: int
    """0-based position in spec.steps."""
    canary_replicas: int
    """Replicas on the new weights at this step."""
    stable_replicas: int
    """Replicas left on the old weights once the canary is ready."""
    surge_replicas: int = 0
    """Extra canary replicas while the step's cache is cold."""
    target_hit_rate: float | None = None
    """Hit rate (0-1) the canary must reach: recoveryPercent of the baseline."""
    observed_hit_rate: float | None = None
    """The canary's last hit rate (0-1)."""
    baseline_hit_rate: float | None = None
    """The stable version's hit rate (0-1) it was judged against."""
    started_at: str = ""
    """When the step started (UTC, RFC 3339)."""
    gate_started_at: str = ""
    """When the canary became ready and the hit-rate window opened (UTC, RFC 3339)."""
    finished_at: str = ""
    """When the step ended (UTC, RFC 3339)."""
    result: StepResult = StepResult.RUNNING
    """Running, Passed, TimedOut, NotReady or Aborted."""


class PreviousVersion(_Status):
    """What the target ran before the rollout: what a rollback restores."""

    weights_digest: str = ""
    """The weights digest before the rollout."""
    image: str = ""
    """The image before the rollout."""
    replicas: int = 0
    """The target's replica count before the rollout."""


class HistoryEntry(_Status):
    """One phase transition."""

    time: str
    """When (UTC, RFC 3339)."""
    from_phase: str
    """Phase before."""
    to_phase: str
    """Phase after."""
    step: int
    """The current step then (1-based; 0 before the first)."""
    reason: str
    """One CamelCase word for why."""
    message: str = ""
    """Why, in words."""


class ModelRolloutStatus(_Status):
    """Where the rollout is, and how it got there."""

    observed_generation: int = 0
    """The metadata.generation this status was computed from."""
    phase: RolloutPhase = RolloutPhase.PENDING
    """Pending, Progressing, Paused, Promoting, Succeeded, RollingBack, RolledBack or Failed."""
    current_step: int = 0
    """The step running now, 1-based; 0 before the first step."""
    total_steps: int = 0
    """Number of steps in spec.steps."""
    step_state: StepState | None = None
    """Scaling (waiting for the canary's pods) or Gating (waiting for the hit rate)."""
    previous: PreviousVersion | None = None
    """What the target ran before: what a rollback restores."""
    baseline_hit_rate: float | None = None
    """The stable version's last cache hit rate (0-1)."""
    canary_hit_rate: float | None = None
    """The canary's last cache hit rate (0-1)."""
    hit_rate_percent: str = ""
    """canaryHitRate for people, a percent to 0.1 ("95.6%"; empty before the first reading):
    the HitRate column of `kubectl get`."""
    baseline_percent: str = ""
    """baselineHitRate the same way: the Baseline column of `kubectl get -o wide`."""
    metric_source: str = ""
    """Where the last hit rates came from (prometheus, cache-stats, or why neither answered)."""
    promotion_started_at: str = ""
    """When promotion began (UTC, RFC 3339)."""
    handoff_started_at: str = ""
    """When the target became ready with the new weights (UTC, RFC 3339)."""
    paused_at: str = ""
    """When spec.paused took effect (UTC, RFC 3339); empty when running."""
    resume_phase: RolloutPhase | None = None
    """The phase a paused rollout resumes in."""
    reason: str = ""
    """Why the last transition happened, one CamelCase word."""
    message: str = ""
    """Why, in words."""
    steps: list[StepStatus] = []
    """Every step started so far."""
    history: list[HistoryEntry] = []
    """The last 50 phase transitions."""
    conditions: list[Condition] = []
    """Ready, Progressing and Degraded (Ready False with InvalidSpec or InvalidTarget: the
    operator cannot act on this rollout)."""
