{{/* The router container's arguments: the `kvfleet router` command line (issue 6's CLI). */}}
{{- define "kvfleet.router.args" -}}
- router
- --host
- 0.0.0.0
- --port
- {{ .Values.router.port | quote }}
- --keys
- /etc/kvfleet/router/keys.yaml
- --fleet-config
- {{ printf "%s/fleet.yaml" .Values.fleetConfig.mountPath | quote }}
{{- if include "kvfleet.redis.configured" . }}
- --redis-url
- $(KVFLEET_REDIS_URL)
{{- end }}
- --log-level
- {{ .Values.router.logLevel | quote }}
{{- end -}}

{{/* The router container's environment. */}}
{{- define "kvfleet.router.env" -}}
{{- /* It signs each forwarded request's tenant with this (docs/security.md). */}}
- name: KVFLEET_ROUTER_SECRET_FILE
  value: /etc/kvfleet/router-secret/secret
{{ include "kvfleet.redisUrlEnv" . }}
{{- end -}}

{{/* The router's keys file: {tenants: {tenant: [key or sha256:<hex>, ...]}} (routing/tenants.py). */}}
{{- define "kvfleet.router.keysFile" -}}
{{- toYaml (dict "tenants" .Values.router.apiKeys.tenants) -}}
{{- end -}}
