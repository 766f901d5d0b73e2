{{/* The replica container's arguments: the `kvfleet replica` command line (issue 5's CLI). */}}
{{- define "kvfleet.replica.args" -}}
- replica
- --model-dir
- {{ .Values.replica.model.dir | quote }}
- --port
- {{ .Values.replica.port | quote }}
{{- end -}}

{{/* The replica container's environment. */}}
{{- define "kvfleet.replica.env" -}}
{{- with .Values.replica.model.weightsDigest }}
- name: KVFLEET_WEIGHTS_DIGEST
  value: {{ . | quote }}
{{- end }}
{{- end -}}
