{{/* The replica container's arguments: the `kvfleet replica` command line (issue 5's CLI). */}}
{{- define "kvfleet.replica.args" -}}
- replica
- --model-dir
- {{ .Values.replica.model.dir | quote }}
{{- with .Values.replica.model.id }}
- --model-id
- {{ . | quote }}
{{- end }}
- --host
- 0.0.0.0
- --port
- {{ .Values.replica.port | quote }}
- --config
- /etc/kvfleet/replica/replica.yaml
- --log-level
- {{ .Values.replica.logLevel | quote }}
{{- end -}}

{{/* The replica container's environment. */}}
{{- define "kvfleet.replica.env" -}}
{{- with .Values.replica.model.weightsDigest }}
- name: KVFLEET_WEIGHTS_DIGEST
  value: {{ . | quote }}
{{- end }}
{{- /* The fleet tier (kvfleet_runtime/fleet/fleet_tier.py): the replica's name in the fleet is its
pod's name (POD_NAME; the operator's home sets and replica list use pod names), peers reach it at
http://POD_IP:<port>, it reads the fleet config and the T2 secret from the mounts below (the
config file may appear later: it is polled), and shares hints in Redis. */}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if eq .Values.replica.engine "vllm" }}
{{- /* A vLLM replica serves T2 on the connector's own port (`kvfleet.peer_port`), not on the
API port: the URL it registers in the hint index says so (POD_IP is defined above, so the kubelet
expands it). */}}
- name: KVFLEET_PEER_URL
  value: {{ printf "http://$(POD_IP):%d" (int .Values.replica.vllm.peerPort) | quote }}
{{- end }}
- name: KVFLEET_PEER_SECRET_FILE
  value: /etc/kvfleet/peer/token
{{- /* docs/security.md: tenant requests need the router's assertion, cache control the
operator's token. */}}
- name: KVFLEET_ROUTER_SECRET_FILE
  value: /etc/kvfleet/router-secret/secret
- name: KVFLEET_OPERATOR_TOKEN_FILE
  value: /etc/kvfleet/operator-token/token
- name: KVFLEET_FLEET_CONFIG
  value: {{ printf "%s/fleet.yaml" .Values.fleetConfig.mountPath | quote }}
{{ include "kvfleet.redisUrlEnv" (dict "context" . "role" "replica") }}
{{- with .Values.replica.nvme }}
{{- if .enabled }}
{{- /* T3 (kvfleet_runtime/nvme): the store file lives on the mounted volume, bounded by its
size; the fleet config's tiers.nvme / tiers.nvme_shadow decide what the replica does with it. */}}
- name: KVFLEET_REPLICA_CACHE__NVME_PATH
  value: {{ .mountPath | quote }}
- name: KVFLEET_REPLICA_CACHE__NVME_CAPACITY_BYTES
  value: {{ mul (int .sizeGiB) 1073741824 | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Non-empty when the vLLM replicas publish their KV events and the router follows them
(`replica.vllm.kvEvents`); a kvfleet replica publishes no such stream. */}}
{{- define "kvfleet.vllm.kvEvents" -}}
{{- if and (eq .Values.replica.engine "vllm") .Values.replica.vllm.kvEvents.enabled -}}true{{- end -}}
{{- end -}}

{{/* vLLM's `--kv-events-config`: its ZMQ publisher bound on every interface of the pod at the
`kv-events` port (vLLM binds only `*` or ipc endpoints), on the topic the router's subscriber
takes (`picker._kv_subscriber.TOPIC`). */}}
{{- define "kvfleet.vllm.kvEventsConfig" -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int .Values.replica.vllm.kvEvents.port)) "topic" "" | toJson -}}
{{- end -}}

{{/* `replica.engine: vllm`: the `vllm serve` command line with kvfleet's KV connector
(docs/vllm.md). The connector's key takes the weights digest of the pod template (a ModelRollout
replaces it) and the served model name, the same fields a kvfleet replica keys its blocks by;
T2 runs in the connector on `kvfleet.peer_port` (the container's `peer` port);
Kubernetes expands $(KVFLEET_WEIGHTS_DIGEST) inside the JSON. The router secret (mounted in every
replica pod) verifies each request's cache_salt, which the router signs per tenant.
kv_load_failure_policy "recompute": vLLM's default ("fail") fails the request whose KV load
failed; a cache fault must cost only the prefill, never the answer. */}}
{{- define "kvfleet.replica.vllmArgs" -}}
{{- $v := .Values.replica.vllm -}}
{{- $extra := dict "kvfleet.host_pool_path" "/dev/shm/kvfleet-host-pool" "kvfleet.num_host_blocks" (int $v.numHostBlocks) "kvfleet.default_tenant" $v.defaultTenant "kvfleet.salt_secret_file" "/etc/kvfleet/router-secret/secret" "kvfleet.peer_port" (int $v.peerPort) -}}
{{- with .Values.replica.model.id }}{{ $_ := set $extra "kvfleet.model_id" . }}{{ end -}}
{{- with .Values.replica.model.weightsDigest }}{{ $_ := set $extra "kvfleet.weights_digest" "$(KVFLEET_WEIGHTS_DIGEST)" }}{{ end -}}
{{- $kvt := dict "kv_connector" "KvfleetConnector" "kv_connector_module_path" "kvfleet_vllm.connector" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $extra -}}
- serve
- {{ .Values.replica.model.dir | quote }}
{{- with .Values.replica.model.id }}
- --served-model-name
- {{ . | quote }}
{{- end }}
- --host
- 0.0.0.0
- --port
- {{ .Values.replica.port | quote }}
- --tensor-parallel-size
- {{ .Values.replica.gpu.count | quote }}
- --enable-prefix-caching
- --kv-transfer-config
- {{ $kvt | toJson | quote }}
{{- if include "kvfleet.vllm.kvEvents" . }}
- --kv-events-config
- {{ include "kvfleet.vllm.kvEventsConfig" . | quote }}
{{- end }}
{{- range $v.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
