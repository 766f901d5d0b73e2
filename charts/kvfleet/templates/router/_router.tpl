{{/* The router container's arguments: the `kvfleet router` command line (issue 6's CLI). */}}
{{- define "kvfleet.router.args" -}}
- router
- --port
- {{ .Values.router.port | quote }}
{{- end -}}

{{/* The router container's environment. */}}
{{- define "kvfleet.router.env" -}}
{{- end -}}

{{/* The router's keys file: {tenants: {tenant: [key or sha256:<hex>, ...]}} (routing/tenants.py). */}}
{{- define "kvfleet.router.keysFile" -}}
{{- toYaml (dict "tenants" .Values.router.apiKeys.tenants) -}}
{{- end -}}
