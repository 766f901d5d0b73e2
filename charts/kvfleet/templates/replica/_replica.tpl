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
{{- end -}}
