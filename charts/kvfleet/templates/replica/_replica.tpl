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
{{- /* The fleet tier (kvfleet_runtime/fleet/wiring.py): the replica's name in the fleet is its
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
{{ include "kvfleet.redisUrlEnv" . }}
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
