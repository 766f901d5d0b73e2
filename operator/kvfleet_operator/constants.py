"""Names shared by the CRDs, the handlers, the manifests and the tests: one place to change them."""

from __future__ import annotations

GROUP = "kvfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

POLICY_KIND = "KVCachePolicy"
POLICY_PLURAL = "kvcachepolicies"
ROLLOUT_KIND = "ModelRollout"
ROLLOUT_PLURAL = "modelrollouts"

FIELD_MANAGER = "kvfleet-operator"

# Where a replica's weights digest is read from and written to: the pod template's annotation
# (what the operator and the router read) and an environment variable (what the replica reads).
WEIGHTS_DIGEST_ANNOTATION = f"{GROUP}/weights-digest"
DEFAULT_DIGEST_ENV = "KVFLEET_WEIGHTS_DIGEST"
# What serves a replica pod (`kvfleet_runtime.wire.ENGINES`), on the pod template (the chart sets
# it from `replica.engine`): copied into the fleet config for the router, and it picks the
# rollout gate's default hit-rate query. Absent or unknown: kvfleet.
ENGINE_ANNOTATION = f"{GROUP}/engine"
# Where a vLLM replica pod's KV connector serves T2 (the chart sets it from
# `replica.vllm.peerPort`): the operator writes http://<pod IP>:<port> into the fleet config as
# the replica's peer_url. Absent, not a port, or on a kvfleet pod: none (T2 is on its API port).
PEER_PORT_ANNOTATION = f"{GROUP}/peer-port"

# Labels the operator puts on what it creates.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "kvfleet-operator"
TRACK_LABEL = f"{GROUP}/track"
ROLLOUT_LABEL = f"{GROUP}/rollout"
POLICY_LABEL = f"{GROUP}/policy"

CANARY_SUFFIX = "-canary"
FLEET_CONFIGMAP_SUFFIX = "-fleet"

# kopf keeps its bookkeeping in annotations under our prefix, never in `status` (whose schema
# is ours and structural: the API server would prune kopf's fields there).
KOPF_ANNOTATION_PREFIX = f"{GROUP}"

# The KopfPeering (ClusterKopfPeering cluster-wide) through which operator replicas agree that
# only one acts; the chart creates it under this name.
PEERING_NAME = "kvfleet"
