{{/* The router container's arguments: the `kvfleet router` command line, or `kvfleet epp`'s
(router.mode: epp), which take the same picker options. */}}
{{- define "kvfleet.router.args" -}}
{{- if eq .Values.router.mode "epp" }}
- epp
- --grpc-host
- 0.0.0.0
- --grpc-port
- {{ .Values.router.epp.grpcPort | quote }}
- --http-host
- 0.0.0.0
- --http-port
- {{ .Values.router.epp.metricsPort | quote }}
- --max-fallbacks
- {{ .Values.router.epp.maxFallbacks | quote }}
{{- else }}
- router
- --host
- 0.0.0.0
- --port
- {{ .Values.router.port | quote }}
{{- end }}
- --keys
- /etc/kvfleet/router/keys.yaml
- --fleet-config
- {{ printf "%s/fleet.yaml" .Values.fleetConfig.mountPath | quote }}
{{- /* No --redis-url: the router reads KVFLEET_REDIS_URL from its environment, so a password in
the URL never reaches its argv (the process list). */}}
{{- if include "kvfleet.router.tokenizer" . }}
- --tokenizer
- {{ .Values.replica.model.dir | quote }}
{{- end }}
{{- if include "kvfleet.vllm.kvEvents" . }}
{{- /* The replicas' KV event streams, at each vLLM replica's pod IP (the fleet config's URL)
on the port their --kv-events-config binds. */}}
- --kv-events-port
- {{ .Values.replica.vllm.kvEvents.port | quote }}
{{- end }}
- --log-level
- {{ .Values.router.logLevel | quote }}
{{- end -}}

{{/* Non-empty when the router reads the model's tokenizer from the replicas' model volume. */}}
{{- define "kvfleet.router.tokenizer" -}}
{{- if and .Values.router.tokenizer.fromModelVolume .Values.replica.model.volume -}}true{{- end -}}
{{- end -}}

{{/* The router container's environment. */}}
{{- define "kvfleet.router.env" -}}
{{- if and (include "kvfleet.router.tokenizer" .) .Values.replica.model.weightsDigest }}
{{- /* For $(KVFLEET_WEIGHTS_DIGEST) in the model folder's path: the chart's digest. After a
rollout the replicas serve another folder; their tokenizer name is a digest of the tokenizer
files, so an unchanged tokenizer still matches, and a changed one turns the override off. */}}
- name: KVFLEET_WEIGHTS_DIGEST
  value: {{ .Values.replica.model.weightsDigest | quote }}
{{- end }}
{{- /* It signs each forwarded request's tenant with this (docs/security.md). */}}
- name: KVFLEET_ROUTER_SECRET_FILE
  value: /etc/kvfleet/router-secret/secret
{{ include "kvfleet.redisUrlEnv" (dict "context" . "role" "router") }}
{{- end -}}

{{/* The router's keys file: {tenants: {tenant: [key or sha256:<hex>, ...]}}
(affinity/api_keys.py). */}}
{{- define "kvfleet.router.keysFile" -}}
{{- toYaml (dict "tenants" .Values.router.apiKeys.tenants) -}}
{{- end -}}


{{/* The gateway's pods as NetworkPolicy peers (router.mode: epp), required: the picker's port and
the replicas' take requests from them. */}}
{{- define "kvfleet.epp.gatewayFrom" -}}
{{- if not .Values.networkPolicy.gatewayFrom -}}
{{- fail "networkPolicy.gatewayFrom must name the gateway's pods when router.mode is epp (NetworkPolicy peers), or set networkPolicy.enabled=false" -}}
{{- end -}}
{{- toYaml .Values.networkPolicy.gatewayFrom -}}
{{- end -}}
