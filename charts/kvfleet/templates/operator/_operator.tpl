{{/* The operator container's arguments: `kvfleet-operator run` (kvfleet_operator/cli.py). */}}
{{- define "kvfleet.operator.args" -}}
- run
- --liveness
- {{ printf "http://0.0.0.0:%d/healthz" (int .Values.operator.healthPort) | quote }}
{{- range .Values.operator.watchNamespaces }}
- --namespace
- {{ . }}
{{- end }}
{{- if not .Values.operator.peering.enabled }}
- --standalone
{{- end }}
{{- if .Values.operator.verbose }}
- --verbose
{{- end }}
{{- end -}}
