"""The `kvfleet.dev/v1alpha1` API: typed specs and statuses of KVCachePolicy and ModelRollout.

These pydantic models are the one source of truth: `crds/*.yaml` are generated from them
(`python -m kvfleet_operator.crdgen`), and the handlers parse what the API server hands them with
the same models. Field names are camelCase on the wire (aliases) and snake_case in Python.

Cross-field rules live twice on purpose: as CEL (`x-kubernetes-validations`) so that the API
server refuses a bad object at `kubectl apply` with the field path, and as validators here so the
pure planners never see one either (an object created before a rule existed, or a unit test).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from kvfleet_runtime.breakeven import GPUS, MEDIA, MODELS
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
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class _Status(BaseModel):
    """Statuses are rebuilt by the planners with `model_copy(update=...)`; fields we do not know
    (a newer operator's) are ignored rather than refused."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


# ---------------------------------------------------------------------------------------------
# shared


class LabelSelector(_Spec):
    """Selects the replica pods this policy governs (a subset of metav1.LabelSelector)."""

    match_labels: Annotated[dict[str, str], Field(min_length=1)]


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Status):
    type: Annotated[str, Field(min_length=1, max_length=316)]
    status: ConditionStatus
    reason: Annotated[str, Field(max_length=1024)] = ""
    message: Annotated[str, Field(max_length=32768)] = ""
    last_transition_time: Annotated[str, Field(json_schema_extra={"format": "date-time"})] = ""
    observed_generation: Annotated[int, Field(ge=0)] = 0


# ---------------------------------------------------------------------------------------------
# KVCachePolicy


class TierMode(StrEnum):
    ENABLED = "Enabled"
    DISABLED = "Disabled"
    AUTO = "Auto"


class FleetKind(StrEnum):
    """Interactive fleets build a tier only when it helps latency; batch fleets also when it only
    helps capacity (revision R1)."""

    INTERACTIVE = "Interactive"
    BATCH = "Batch"


class ModelSpec(_Spec):
    """The model and hardware the break-even decision is made for."""

    profile: Annotated[
        str,
        Field(
            description="built-in model profile",
            json_schema_extra={"enum": list(MODELS)},
        ),
    ] = "reference-70b"
    model_id: Annotated[
        str, Field(max_length=253, description="model id published to the fleet (default: profile)")
    ] = ""
    kv_dtype: Annotated[str, Field(json_schema_extra={"enum": [d.value for d in KVDtype]})] = "fp16"
    gpu: Annotated[str, Field(json_schema_extra={"enum": list(GPUS)})] = "h100"
    tp_degree: Annotated[int, Field(ge=1, le=64)] = 4
    prefix_tokens: Annotated[int, Field(ge=16, le=1_048_576)] = 2000


class TierSpec(_Spec):
    mode: TierMode = TierMode.AUTO
    medium: Annotated[
        str | None,
        Field(
            description="storage medium profile (default: the tier's usual medium)",
            json_schema_extra={"enum": list(MEDIUM_NAMES)},
        ),
    ] = None
    measured_bandwidth_g_bps: Annotated[
        float | None,
        Field(
            alias="measuredBandwidthGBps",
            gt=0,
            le=100_000,
            description="measured bandwidth in GB/s (1e9 B/s); Auto decides with it",
        ),
    ] = None


_MEASURED_ONLY_AUTO = _cel(
    "self.mode == 'Auto' || !has(self.measuredBandwidthGBps)",
    "measuredBandwidthGBps is only used when mode is Auto",
    ".measuredBandwidthGBps",
)


class DeviceTierSpec(TierSpec):
    model_config = ConfigDict(json_schema_extra=_validations(_MEASURED_ONLY_AUTO))


class NvmeTierSpec(TierSpec):
    """Local NVMe. Off for interactive traffic unless a measurement beats the break-even (R6);
    `shadow` runs the measurement (store, fetch, discard) whatever the mode."""

    model_config = ConfigDict(json_schema_extra=_validations(_MEASURED_ONLY_AUTO))
    shadow: bool = True


class TiersSpec(_Spec):
    device: DeviceTierSpec = DeviceTierSpec()
    host: DeviceTierSpec = DeviceTierSpec()
    peer: DeviceTierSpec = DeviceTierSpec()
    nvme: NvmeTierSpec = NvmeTierSpec()


class AdmissionSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "self.hotSightings >= self.minSightings",
                "hotSightings must be >= minSightings",
                ".hotSightings",
            )
        )
    )
    min_sightings: Annotated[int, Field(ge=1, le=16)] = 2
    hot_sightings: Annotated[int, Field(ge=2, le=1024)] = 3
    pin_max_tokens: Annotated[int, Field(ge=0, le=1_048_576)] = 2048
    store_queue_size: Annotated[int, Field(ge=1, le=1_048_576)] = 256
    thrash_ratio: Annotated[float, Field(gt=0, le=1)] = 0.9

    @model_validator(mode="after")
    def _hot_after_min(self) -> AdmissionSpec:
        if self.hot_sightings < self.min_sightings:
            raise ValueError(
                f"hotSightings ({self.hot_sightings}) must be >= minSightings "
                f"({self.min_sightings})"
            )
        return self


class AffinitySpec(_Spec):
    k: Annotated[int, Field(ge=1, le=16)] = 3
    occupancy_threshold: Annotated[float, Field(gt=0, le=1)] = 0.85


class KVCachePolicySpec(_Spec):
    """A cache-aware fleet: which replicas, what model and hardware, which tiers, which knobs."""

    selector: LabelSelector
    replica_port: Annotated[int, Field(ge=1, le=65535)] = 8000
    fleet: FleetKind = FleetKind.INTERACTIVE
    model: ModelSpec = ModelSpec()
    tiers: TiersSpec = TiersSpec()
    admission: AdmissionSpec = AdmissionSpec()
    affinity: AffinitySpec = AffinitySpec()
    tenants: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=253)]],
        Field(max_length=100_000, description="tenants whose home sets are published"),
    ] = []
    platform_prefixes: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=253)]],
        Field(
            max_length=1024,
            description="platform-owned prefixes that may be shared across tenants",
        ),
    ] = []
    config_map_name: Annotated[
        str | None,
        Field(
            max_length=253,
            pattern=DNS_LABEL_PATTERN,
            description="the fleet ConfigMap (default: <policy>-fleet)",
        ),
    ] = None


class TierDecisionStatus(_Status):
    tier: str
    medium: str
    enabled: bool
    reason: str


class HomeSetSummary(_Status):
    num_tenants: int = 0
    num_replicas: int = 0
    k: int = 0
    min_tenants_per_replica: int = 0
    max_tenants_per_replica: int = 0
    config_map: str = ""
    config_hash: str = ""


class KVCachePolicyStatus(_Status):
    observed_generation: int = 0
    break_even_g_bps: Annotated[float, Field(alias="breakEvenGBps")] = 0.0
    tiers_summary: str = ""
    tiers: list[TierDecisionStatus] = []
    home_sets: HomeSetSummary = HomeSetSummary()
    conditions: list[Condition] = []


# ---------------------------------------------------------------------------------------------
# ModelRollout


class TargetRef(_Spec):
    kind: Literal["Deployment"] = "Deployment"
    name: Annotated[str, Field(min_length=1, max_length=240, pattern=DNS_LABEL_PATTERN)]
    container: Annotated[
        str | None,
        Field(max_length=63, description="container carrying the weights (default: the first)"),
    ] = None


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
    percent: Annotated[int | None, Field(ge=1, le=100)] = None

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
    window_seconds: Annotated[int, Field(ge=1, le=86_400)] = 1800
    hold_seconds: Annotated[
        int, Field(ge=0, le=86_400, description="minimum time in a step before it may pass")
    ] = 60
    ready_timeout_seconds: Annotated[
        int, Field(ge=1, le=86_400, description="time for the canary's pods to become ready")
    ] = 600
    check_interval_seconds: Annotated[int, Field(ge=1, le=3600)] = 15


class SurgeMode(StrEnum):
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
    replicas: Annotated[int | None, Field(ge=0, le=10_000)] = None
    replica_prefill_tokens_per_second: Annotated[float | None, Field(gt=0, le=1e9)] = None
    max_replicas: Annotated[int, Field(ge=0, le=10_000)] = 16

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
    hit_rate_query: Annotated[str, Field(min_length=1, max_length=4096)] = DEFAULT_HIT_RATE_QUERY
    saved_prefill_query: Annotated[str, Field(min_length=1, max_length=4096)] = (
        DEFAULT_SAVED_PREFILL_QUERY
    )
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 5.0


class CacheStatsSource(_Spec):
    """Fallback: read each ready pod's `GET /cache/stats` and aggregate its token counters."""

    enabled: bool = True
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    path: Annotated[str, Field(pattern=r"^/", max_length=1024)] = "/cache/stats"
    timeout_seconds: Annotated[float, Field(gt=0, le=60)] = 2.0


class MetricsSpec(_Spec):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            _cel(
                "has(self.prometheus) || self.cacheStats.enabled",
                "need a metric source: prometheus, or cacheStats.enabled",
            )
        )
    )
    prometheus: PrometheusSource | None = None
    cache_stats: CacheStatsSource = CacheStatsSource()

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
    weights_digest: Annotated[
        str, Field(pattern=DIGEST_PATTERN, description="sha256 of the new weights; never a tag")
    ]
    image: Annotated[
        str | None, Field(min_length=1, max_length=1024, description="new image (optional)")
    ] = None
    digest_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=253)] = (
        "KVFLEET_WEIGHTS_DIGEST"
    )
    steps: Annotated[list[RolloutStep], Field(min_length=1, max_length=20)] = list(DEFAULT_STEPS)
    gate: GateSpec = GateSpec()
    surge: SurgeSpec = SurgeSpec()
    metrics: MetricsSpec = MetricsSpec()
    paused: bool = False
    abort: bool = False

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
    index: int
    canary_replicas: int
    stable_replicas: int
    surge_replicas: int = 0
    target_hit_rate: float | None = None
    observed_hit_rate: float | None = None
    baseline_hit_rate: float | None = None
    started_at: str = ""
    gate_started_at: str = ""
    finished_at: str = ""
    result: StepResult = StepResult.RUNNING


class PreviousVersion(_Status):
    """What the target ran before the rollout: what a rollback restores."""

    weights_digest: str = ""
    image: str = ""
    replicas: int = 0


class HistoryEntry(_Status):
    time: str
    from_phase: str
    to_phase: str
    step: int
    reason: str
    message: str = ""


class ModelRolloutStatus(_Status):
    observed_generation: int = 0
    phase: RolloutPhase = RolloutPhase.PENDING
    current_step: Annotated[int, Field(description="1-based; 0 before the first step")] = 0
    total_steps: int = 0
    step_state: StepState | None = None
    previous: PreviousVersion | None = None
    baseline_hit_rate: float | None = None
    canary_hit_rate: float | None = None
    metric_source: Annotated[str, Field(description="where the last hit rates came from")] = ""
    promotion_started_at: str = ""
    handoff_started_at: str = ""
    paused_at: str = ""
    resume_phase: RolloutPhase | None = None
    reason: Annotated[str, Field(description="why the last transition happened")] = ""
    message: str = ""
    steps: list[StepStatus] = []
    history: list[HistoryEntry] = []
    conditions: list[Condition] = []
